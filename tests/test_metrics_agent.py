"""AgentMetrics: the agent's events as metrics, the exposition format, and bounded labels."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from elastictk.metrics import worker as worker_mod
from elastictk.metrics.agent_metrics import STATES, AgentMetrics
from elastictk.metrics.labels import (
    EXIT_CODE, FAILURE_REASONS, OTHER, SIGNAL, BoundedLabel, exit_detail, membership_cause,
)
from elastictk.metrics.steps import WorkerStepsBlock

ROOT = Path(__file__).resolve().parent.parent
L = {"run_id": "j", "node": "n0", "role": "trainer"}


class Clock:
    """A clock the test moves by hand, so durations are exact (the metrics take it as input)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(clock: Clock | None = None, **kw: Any) -> tuple[CollectorRegistry, AgentMetrics]:
    reg = CollectorRegistry()
    m = AgentMetrics(reg, job="j", node="n0", role="trainer", clock=clock or Clock(), **kw)
    return reg, m


def value(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, {**L, **labels})


def test_a_failure_and_restart_move_every_related_metric() -> None:
    clock = Clock()
    reg, m = make(clock, max_restarts=2, local_world_size=2)
    assert value(reg, "elastictk_restarts_total") == 0
    assert value(reg, "elastictk_restarts_remaining") == 2
    clock.t += 3
    m("round_joined", round=0, rank=0, world=2)
    assert value(reg, "elastictk_rendezvous_duration_seconds_sum") == 3
    assert value(reg, "elastictk_nodes") == 2 and value(reg, "elastictk_world_size") == 4
    m("workers_started", attempt=0, restart_count=0, pids={0: 101, 1: 102})
    assert value(reg, "elastictk_workers_running") == 2
    assert value(reg, "elastictk_agent_state", state="running") == 1
    clock.t += 60
    m("worker_failed", rank=3, local_rank=1, exit="SIGKILL", first_in_job=True)
    assert value(reg, "elastictk_worker_failures_total", reason="signal", detail="SIGKILL") == 1
    assert value(reg, "elastictk_workers_running") == 0
    assert value(reg, "elastictk_agent_state", state="recovering") == 1
    clock.t += 1
    m("restart", restart_count=1, delay_s=2.0, reason="worker failed")
    assert value(reg, "elastictk_restarts_total") == 1
    assert value(reg, "elastictk_restarts_remaining") == 1
    clock.t += 5  # 2 s of back-off, then 3 s of rendezvous
    m("round_joined", round=1, rank=0, world=2)
    assert value(reg, "elastictk_rendezvous_rounds_total") == 2
    assert value(reg, "elastictk_rendezvous_duration_seconds_sum") == 3 + 3
    clock.t += 1
    m("workers_started", attempt=1, restart_count=1, pids={0: 103, 1: 104})
    assert value(reg, "elastictk_recovery_duration_seconds_count") == 1
    assert value(reg, "elastictk_recovery_duration_seconds_sum") == 7  # failure seen → running
    assert value(reg, "elastictk_worker_group_starts_total") == 2
    m("job_finished", restarts=1)
    assert value(reg, "elastictk_agent_state", state="succeeded") == 1
    assert sum(value(reg, "elastictk_agent_state", state=s) or 0 for s in STATES) == 1


def test_restart_budget_reaches_zero_and_job_fails() -> None:
    reg, m = make(max_restarts=1)
    m("workers_started", attempt=0, restart_count=0, pids={0: 1})
    m("worker_failed", rank=0, local_rank=0, exit="code 3", first_in_job=True)
    m("restart", restart_count=1, delay_s=0, reason="x")
    m("workers_started", attempt=1, restart_count=1, pids={0: 2})
    assert value(reg, "elastictk_restarts_remaining") == 0
    m("worker_failed", rank=0, local_rank=0, exit="code 3", first_in_job=True)
    m("job_failed", reason="no restarts left")
    assert value(reg, "elastictk_worker_failures_total", reason="exit_code", detail="3") == 2
    assert value(reg, "elastictk_agent_state", state="failed") == 1
    assert value(reg, "elastictk_restarts_remaining") == 0


def test_losing_the_store_fails_the_node() -> None:
    reg, m = make()
    m("workers_started", attempt=0, restart_count=0, pids={0: 1})
    m("store_lost", error="connection refused")
    assert value(reg, "elastictk_agent_state", state="failed") == 1
    assert value(reg, "elastictk_workers_running") == 0


def test_timer_expiry_classifies_the_kill_that_follows() -> None:
    reg, m = make()
    m("workers_started", attempt=0, restart_count=0, pids={0: 1, 1: 2})
    m("timer_expired", local_rank=1, scope="forward")
    m("worker_failed", rank=1, local_rank=1, exit="SIGKILL", first_in_job=True)
    assert value(reg, "elastictk_timer_expirations_total", scope="forward") == 1
    assert value(reg, "elastictk_worker_failures_total", reason="timer_expired", detail="forward") == 1
    assert value(reg, "elastictk_worker_failures_total", reason="signal", detail="SIGKILL") is None


def test_membership_changes_lost_nodes_and_scaling() -> None:
    reg, m = make(local_world_size=4)
    m("round_joined", round=0, rank=0, world=2)
    m("workers_started", attempt=0, restart_count=0, pids={})
    # the membership watch's own wording
    m("membership_changed", reason="node host-1-ab (rank 1) lost: no heartbeat for 12.0s")
    assert value(reg, "elastictk_worker_failures_total", reason="lost_node", detail="") == 1
    assert value(reg, "elastictk_membership_changes_total", cause="lost_node") == 1
    m("round_joined", round=1, rank=0, world=1)
    assert value(reg, "elastictk_scale_events_total", direction="down") == 1
    assert value(reg, "elastictk_world_size") == 4
    m("workers_started", attempt=1, restart_count=0, pids={}, world_size=4)
    m("membership_changed", reason="round 2 opened: 1 node(s) arrived")
    assert value(reg, "elastictk_membership_changes_total", cause="node_joined") == 1
    assert value(reg, "elastictk_agent_state", state="rendezvous") == 1
    m("round_joined", round=2, rank=0, world=3)
    assert value(reg, "elastictk_scale_events_total", direction="up") == 1
    m("peer_failed", by="host-2")
    assert value(reg, "elastictk_peer_failures_total") == 1


def test_unknown_events_and_odd_fields_never_raise() -> None:
    reg, m = make(max_restarts=3)
    m("something_new", anything=object(), n=1)
    m("restart", restart_count="not a number", delay_s=None)
    m("round_joined", world="many")
    m("workers_started")  # no fields at all
    m("worker_failed", exit=None)
    assert value(reg, "elastictk_events_total", kind="something_new") == 1
    assert value(reg, "elastictk_restarts_total") == 1
    assert value(reg, "elastictk_worker_failures_total", reason="other", detail="other") == 1


def test_exposition_round_trips_through_the_parser() -> None:
    with WorkerStepsBlock(2) as block:
        clock = Clock()
        reg, m = make(clock, max_restarts=2, local_world_size=2, steps=block)
        m("round_joined", round=0, rank=0, world=1)
        m("workers_started", attempt=0, restart_count=0, pids={0: 1, 1: 2})
        clock.t += 10
        writer = worker_mod._Slot(block.path, 1)
        for d in (0.01, 0.2, 3.0):
            writer.record(d)
        m("worker_failed", rank=1, local_rank=1, exit="SIGSEGV", first_in_job=True)
        m("restart", restart_count=1, delay_s=0, reason="x")
        del writer
        text = generate_latest(reg).decode()
        parsed = {(s.name, tuple(sorted(s.labels.items()))): s.value
                  for fam in text_string_to_metric_families(text) for s in fam.samples}
        direct = {(s.name, tuple(sorted(s.labels.items()))): s.value
                  for fam in reg.collect() for s in fam.samples}
        assert parsed.keys() == direct.keys()
        for key, v in direct.items():
            assert parsed[key] == pytest.approx(v, rel=1e-9), key
        names = {fam.name for fam in text_string_to_metric_families(text)}
        assert {"elastictk_steps", "elastictk_step_duration_seconds", "elastictk_goodput_ratio",
                "elastictk_restarts", "elastictk_restarts_remaining"} <= names
        assert all(n.startswith("elastictk_") for n in names)
        assert parsed[("elastictk_step_duration_seconds_count", tuple(sorted(L.items())))] == 3


def series(reg: CollectorRegistry) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {(s.name, tuple(sorted(s.labels.items()))) for fam in reg.collect() for s in fam.samples}


def churn(m: AgentMetrics, rng: random.Random, n: int, *, adversarial: bool) -> None:
    """Events whose fields vary the way real ones do (PIDs, ranks, steps, rounds); with
    ``adversarial``, also exit codes, signal names, timer scopes, kinds and reasons at random."""
    sigs = list(signal.Signals)
    for i in range(n):
        pid = rng.randrange(1, 4_000_000)
        m("workers_started", attempt=i, restart_count=i, pids={rng.randrange(8): pid}, step=i)
        if adversarial:
            exit_: Any = rng.choice([f"code {rng.randrange(-300, 100_000)}", rng.choice(sigs).name,
                                     rng.randrange(-64, 1000), f"weird {pid}", None])
            scope, kind = f"scope-{rng.randrange(1000)}", f"custom_{rng.randrange(10_000)}"
        else:
            exit_, scope, kind = rng.choice(["SIGKILL", "code 1"]), "step", "custom"
        m("timer_expired", local_rank=rng.randrange(8), scope=scope, pid=pid)
        m("worker_failed", rank=rng.randrange(10_000), local_rank=rng.randrange(8), exit=exit_, pid=pid)
        m("membership_changed", reason=f"node host-{pid} (rank {i}) lost: no heartbeat for {i}s")
        m(kind, pid=pid)
        m("restart", restart_count=i, delay_s=0, reason=f"worker {pid} failed at step {i}")
        m("round_joined", round=i, rank=0, world=rng.randrange(1, 100))
        m("peer_failed", by=f"host-{pid}")


def test_pids_steps_and_ranks_never_add_series() -> None:
    with WorkerStepsBlock(8) as block:
        reg, m = make(max_restarts=5, local_world_size=8, steps=block)
        rng = random.Random(7)
        churn(m, rng, 50, adversarial=False)
        early = series(reg)
        churn(m, rng, 1000, adversarial=False)
        assert series(reg) == early
    values = {v for _, labels in early for k, v in labels if k not in ("le", "local_rank")}
    assert not any(v.isdigit() and int(v) > 255 for v in values)  # no PID, step or round


def test_free_text_label_values_are_capped() -> None:
    with WorkerStepsBlock(8) as block:
        reg, m = make(max_restarts=5, local_world_size=8, steps=block)
        rng = random.Random(11)
        churn(m, rng, 1000, adversarial=True)
        after_1000 = series(reg)
        churn(m, rng, 1000, adversarial=True)
        after_2000 = series(reg)
    labels_seen = {k for _, labels in after_2000 for k, _ in labels}
    assert labels_seen <= {"run_id", "node", "role", "reason", "detail", "scope", "cause", "direction",
                           "state", "kind", "local_rank", "le"}
    failures = {s for s in after_2000 if s[0] == "elastictk_worker_failures_total"}
    # 24 exit codes or signal names and 16 timer scopes (each with "other"), and lost_node
    assert len(failures) <= 25 + 17 + 1
    kinds = {dict(s[1])["kind"] for s in after_2000 if s[0] == "elastictk_events_total"}
    assert len(kinds) <= 15 + 16 + 1  # the known kinds, 16 new ones, "other"
    assert len(after_2000) <= len(after_1000) + 2 * 17  # only failures by admitted scope may appear


@given(st.one_of(st.integers(-10_000, 10_000), st.text(max_size=30), st.none(), st.booleans(),
                 st.sampled_from([s.name for s in signal.Signals] + ["code 1", "exit code 255", "KILL"])))
def test_exit_detail_is_always_from_a_closed_set(exit_: Any) -> None:
    reason, detail = exit_detail(exit_)
    assert reason in FAILURE_REASONS
    if reason == EXIT_CODE:
        assert detail == OTHER or 0 <= int(detail) <= 255
    elif reason == SIGNAL:
        assert detail == OTHER or detail in {s.name for s in signal.Signals}
    else:
        assert detail == OTHER


def test_exit_detail_reads_every_spelling() -> None:
    assert exit_detail("SIGKILL") == ("signal", "SIGKILL")
    assert exit_detail("kill") == ("signal", "SIGKILL")
    assert exit_detail("code 3") == ("exit_code", "3")
    assert exit_detail("exit code 1") == ("exit_code", "1")
    assert exit_detail(-11) == ("signal", "SIGSEGV")
    assert exit_detail(70000) == ("exit_code", "other")
    assert membership_cause("lost the rendezvous store: connection refused") == "store_lost"
    assert membership_cause("the job was shut down") == "shutdown"


@given(st.integers(1, 20), st.lists(st.text(max_size=12), max_size=60))
def test_bounded_label_admits_at_most_its_limit(limit: int, values: list[str]) -> None:
    label = BoundedLabel(limit, known=["a"])
    out = {label(v) for v in values}
    assert len(out - {"a", OTHER}) <= limit
    assert all(label(v) == label(v) for v in values)  # stable once admitted


def test_goodput_and_losses_from_real_worker_processes() -> None:
    """Two attempts of one worker process each; the first fails after an unsaved tail."""
    clock = Clock()
    code = ("import elastictk.metrics as etm, time\n"
            "for i in range({n}):\n"
            "    with etm.step_timer():\n"
            "        time.sleep(0.02)\n"
            "    if i + 1 == {ckpt}: etm.checkpoint()\n")
    env = {k: v for k, v in os.environ.items() if k != worker_mod.ENV_PATH}
    with WorkerStepsBlock(1) as block:
        reg, m = make(clock, steps=block)
        env.update(block.env(), LOCAL_RANK="0")
        m("workers_started", attempt=0, restart_count=0, pids={0: 1})
        subprocess.run([sys.executable, "-c", code.format(n=10, ckpt=5)], env=env, cwd=ROOT, check=True, timeout=60)
        step_s = value(reg, "elastictk_step_seconds_total")
        assert step_s is not None and step_s >= 10 * 0.02
        clock.t += step_s / 0.5  # the steps took half of the wall time
        assert value(reg, "elastictk_goodput_ratio") == pytest.approx(0.5)
        m("worker_failed", rank=0, local_rank=0, exit="SIGKILL", first_in_job=True)
        assert value(reg, "elastictk_lost_steps_total") == 5
        lost_s = value(reg, "elastictk_lost_step_seconds_total")
        assert lost_s is not None and 0 < lost_s < step_s
        assert value(reg, "elastictk_goodput_ratio") == pytest.approx((step_s - lost_s) / (step_s / 0.5))
        m("restart", restart_count=1, delay_s=0, reason="x")
        m("workers_started", attempt=1, restart_count=1, pids={0: 2})
        subprocess.run([sys.executable, "-c", code.format(n=4, ckpt=0)], env=env, cwd=ROOT, check=True, timeout=60)
        assert value(reg, "elastictk_steps_total", local_rank="0") == 14
        assert value(reg, "elastictk_lost_steps_total") == 5  # the running attempt loses nothing yet
        m("job_finished", restarts=1)
        assert value(reg, "elastictk_lost_steps_total") == 5  # finished work is never lost
        frozen = value(reg, "elastictk_goodput_ratio")
        clock.t += 1000
        assert value(reg, "elastictk_goodput_ratio") == frozen  # the wall clock stops at the end
        assert value(reg, "elastictk_last_step_time_seconds") is not None


def test_series_carry_run_id_not_job_and_no_created_series() -> None:
    """``job`` is the label Prometheus sets on every scraped series: elastictk's run id is
    ``run_id``; and no counter or histogram exports a ``_created`` series."""
    with WorkerStepsBlock(2) as block:
        reg, m = make(max_restarts=2, local_world_size=2, steps=block)
        m("round_joined", round=0, rank=0, world=1)
        m("workers_started", attempt=0, restart_count=0, pids={0: 101, 1: 102})
        m("worker_failed", rank=1, local_rank=1, exit="SIGKILL", first_in_job=True)
        m("restart", restart_count=1, delay_s=0.0)
        m("recovery", path="restart-all", phases_ms={"detect": 1.0}, steps_redone=2)
        text = generate_latest(reg).decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert samples and all(s.labels.get("run_id") == "j" and "job" not in s.labels for s in samples)
    assert not [s.name for s in samples if s.name.endswith("_created")]
    assert "_created" not in text

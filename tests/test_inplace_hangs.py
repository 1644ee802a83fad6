"""Hangs in in-place jobs, caught and named; and chaos's own accounting of hangs and lost nodes.

End to end through ``elastictk-chaos`` (real agents, real workers, real signals): one run per
behaviour, the rest at unit level.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.faults import Fault, PlanError, generate_plan, plan_of
from tests.helpers.chaosrun import chaos, report

ROOT = Path(__file__).resolve().parent.parent
INPLACE = str(ROOT / "examples" / "train_inplace.py")
INPLACE_JOB = ["--standalone", "--nproc-per-node", "3", "--max-restarts", "3", "--recovery", "in-place",
               "--collective-timeout", "3"]
INPLACE_CMD = ["--", INPLACE, "--steps", "40", "--step-time", "0.02"]


def events(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "r" / "chaos-events.jsonl").read_text().splitlines() if line]


def checks(d: dict) -> dict[str, bool]:
    return {c["name"]: c["ok"] for c in d["checks"]}


def test_a_stopped_rank_in_place_is_named_with_its_stacks_before_the_kill(tmp_path: Path) -> None:
    plan_of([Fault.of("hang", "rank:1", at_step=5)], watchdog_s=3).save(tmp_path / "plan.json")
    r = chaos(tmp_path, "--plan", "plan.json", *INPLACE_JOB, *INPLACE_CMD)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    d = report(tmp_path)
    assert all(c["ok"] for c in d["checks"]), d["checks"]
    assert checks(d)["every hang caught, its rank named"]
    evs = events(tmp_path)
    kinds = [e["kind"] for e in evs]
    hang = next(e for e in evs if e["kind"] == "hang_detected")
    assert hang["fields"]["rank"] == 1 and hang["fields"]["culprits"] == [1]
    assert hang["fields"]["trigger"] == "group_timeout" and sorted(hang["fields"]["blocked"]) == [0, 2]
    # named before the kill, the kill before the replacement, and recovered in place
    assert kinds.index("hang_detected") < kinds.index("worker_frozen") < kinds.index("inplace_recovery")
    assert "restart" not in kinds
    failed = next(e for e in evs if e["kind"] == "worker_failed")
    assert failed["fields"]["rank"] == 1 and failed["fields"]["cause"] == "hang_detected"
    stacks = Path(hang["fields"]["report"]).read_text()
    assert "CULPRIT" in stacks and "rank 1 " in stacks
    if hang["fields"]["stacks_from"] == "py-spy":  # else it says why not (ptrace refused)
        assert "train_inplace.py" in stacks


def test_the_collective_fault_survives_run_elastic_turning_the_timers_off() -> None:
    """The order a worker under chaos and run_elastic sees: collective timers on, the fault's
    wrapper on top, then ``unwatch_collectives``: the wrapper stays (its hang still blocks) and
    calls the untimed all_reduce (no timer around a survivor's collective)."""
    import torch.distributed as dist

    from elastictk.faults import collective
    from elastictk.timer import collectives

    bare = dist.all_reduce
    hits: list[str] = []
    try:
        collectives.watch_collectives(30.0)
        collective.ensure_wrapped(on_hang=lambda: hits.append("hang check"))
        collectives.unwatch_collectives()
        wrapper = dist.all_reduce
        assert wrapper is not bare and getattr(wrapper, "__elastictk_fault_inner__", None) is not None
        inner = getattr(wrapper, "__elastictk_fault_inner__")
        assert collective._current(inner) is bare
        try:
            dist.all_reduce(None)  # no process group: the bare all_reduce refuses, after the hook
        except (ValueError, RuntimeError, AttributeError, TypeError):
            pass
        assert hits == ["hang check"]
    finally:
        collective.uninstall()
        collectives.unwatch_collectives()
    assert dist.all_reduce is bare


def test_a_hang_in_collective_in_place_is_caught_and_recovered_in_place(tmp_path: Path) -> None:
    plan_of([Fault.of("hang-in-collective", "rank:1", at_step=5)], watchdog_s=3).save(tmp_path / "plan.json")
    r = chaos(tmp_path, "--plan", "plan.json", *INPLACE_JOB, *INPLACE_CMD)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    d = report(tmp_path)
    assert all(c["ok"] for c in d["checks"]), d["checks"]
    assert d["totals"]["restarts"] == 1 and d["faults"][0]["detected_after"] is not None
    evs = events(tmp_path)
    kinds = [e["kind"] for e in evs]
    expired = next(e for e in evs if e["kind"] == "timer_expired")
    assert expired["fields"]["rank"] == 1 and expired["fields"]["scope"] == "all_reduce"
    assert "inplace_recovered" in kinds and "restart" not in kinds and "inplace_fallback" not in kinds


def test_a_frozen_ddp_rank_caught_by_the_progress_watchdog_is_linked_to_its_fault(tmp_path: Path) -> None:
    """No --collective-timeout, only --progress-timeout: the hang needs a restart all the same,
    and its detection is the watchdog's verdict."""
    plan_of([Fault.of("hang", "rank:1", at_s=2)]).save(tmp_path / "plan.json")
    r = chaos(tmp_path, "--plan", "plan.json", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
              "--progress-timeout", "4", "--", str(ROOT / "examples" / "train_ddp.py"), "--epochs", "6",
              "--samples", "160", "--step-time", "0.05", "--ckpt-dir", "{run_dir}")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    d = report(tmp_path)
    ok = checks(d)
    assert ok["restarts counted == failures that needed one"] and ok["every fault that needed a restart was detected"]
    assert ok["every hang caught, its rank named"], d["checks"]
    row = d["faults"][0]
    assert row["fired"] and row["detected_after"] is not None and 3.5 <= row["detected_after"] < 15
    assert row["restarts_used"] == 1
    assert "1 restart(s) for 1 expected" in r.stdout


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32), count=st.integers(1, 6), nodes=st.integers(2, 5),
       spare=st.booleans(), kinds=st.sampled_from([["kill-agent"], ["kill-agent", "store-outage"],
                                                   ["kill-agent", "sigkill", "store-outage"]]))
def test_a_seeded_plan_never_aims_a_kill_at_a_node_an_earlier_kill_took_down(
        seed: int, count: int, nodes: int, spare: bool, kinds: list[str]) -> None:
    try:
        plan = generate_plan(seed, count, nodes, kinds=kinds, seconds=(1.0, 100.0), min_gap_s=10.0,
                             nodes=nodes, spare_nodes=(0,) if spare else ())
    except PlanError as e:  # only when kills are all it may draw and the nodes run out
        assert kinds == ["kill-agent"] and count > nodes - spare, e
        assert "more kill-agent faults than nodes" in str(e) and "\n" not in str(e)
        return
    hit = [f.target.index for f in plan.faults if f.kind == "kill-agent"]
    assert len(hit) == len(set(hit)), plan.faults
    assert not spare or 0 not in hit
    again = generate_plan(seed, count, nodes, kinds=kinds, seconds=(1.0, 100.0), min_gap_s=10.0,
                          nodes=nodes, spare_nodes=(0,) if spare else ())
    assert again == plan  # still replayable from its seed


def test_two_kills_on_three_nodes_hit_two_nodes() -> None:
    """The shape that failed: --nodes 3, c10d (node 0 spared), two kill-agent faults."""
    for seed in range(40):
        plan = generate_plan(seed, 2, 3, kinds=["kill-agent"], seconds=(1.0, 30.0), min_gap_s=10.0,
                             nodes=3, spare_nodes=(0,))
        assert sorted(f.target.index for f in plan.faults) == [1, 2], (seed, plan.faults)
    with pytest.raises(PlanError, match="more kill-agent faults than nodes"):
        generate_plan(0, 3, 3, kinds=["kill-agent"], seconds=(1.0, 40.0), min_gap_s=10.0, nodes=3,
                      spare_nodes=(0,))

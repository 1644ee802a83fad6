"""Stragglers (--straggler-action report): the scoring's properties, real jobs in which one rank
is slow (named: event and log line) or none is (nobody named), the flags, and the chaos check."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from hypothesis import example, given, strategies as st

from elastictk.agent.stragglers import Flagger, RankWindow, Score, score_window
from elastictk.chaos.checks import _stragglers, straggler_settings
from elastictk.chaos.rows import FaultRow

ROOT = Path(__file__).resolve().parent.parent
LOOP = ROOT / "tests" / "helpers" / "straggler_loop.py"
RUN = [sys.executable, "-m", "elastictk.run"]

per_step = st.floats(min_value=0.005, max_value=1.0)
steps = st.integers(min_value=1, max_value=200)


@given(st.lists(st.tuples(per_step, steps), min_size=2, max_size=16), st.floats(1.1, 10))
def test_equal_ranks_are_never_past(ranks: list[tuple[float, int]], threshold: float) -> None:
    """Ranks with the same own time per step: nobody is past, whatever the step counts."""
    same = ranks[0][0]
    ws = [RankWindow(i, n, same * n) for i, (_, n) in enumerate(ranks)]
    assert not any(s.past for s in score_window(ws, 1.0, threshold))


@example([1, 1], 0.8586808645821159, 5.0625, 1.0)  # exactly the threshold: a few ulps below it in floats
@given(st.lists(steps, min_size=2, max_size=16), per_step, st.floats(1.1, 10), st.floats(1.0, 50))
def test_the_slow_rank_and_only_it_is_past(counts: list[int], base: float, threshold: float,
                                           factor_over: float) -> None:
    """One rank ``threshold x factor_over`` slower than the others (who agree): it alone is past,
    and its median is theirs (it does not drag the median it is compared with)."""
    slow = len(counts) // 2
    factor = threshold * factor_over
    n = 10  # steps of every rank in the window: the share is then large enough
    ws = [RankWindow(i, n, base * n * (factor if i == slow else 1.0)) for i in range(len(counts))]
    window = n * base * factor  # the window is the slow rank's steps: it waited for no one
    scores = {s.rank: s for s in score_window(ws, window, threshold)}
    assert [r for r, s in scores.items() if s.past] == [slow]
    assert abs(scores[slow].median - base) < 1e-9
    assert abs(scores[slow].slowdown - factor) / factor < 1e-6


@given(st.lists(st.tuples(per_step, steps), min_size=2, max_size=16), st.floats(1.1, 10), st.floats(0.1, 60))
def test_scores_are_scale_free_in_the_threshold_test(ranks: list[tuple[float, int]], threshold: float,
                                                     window: float) -> None:
    """Whoever is past is slower than the others' median by the threshold and cost the group at
    least the minimum share of the window."""
    ws = [RankWindow(i, n, p * n) for i, (p, n) in enumerate(ranks)]
    for s in score_window(ws, window, threshold):
        if s.past:
            assert s.per_step >= threshold * max(s.median, 1e-3) * (1 - 1e-9)
            assert s.share >= 0.05


def _score(rank: int, past: bool) -> Score:
    return Score(rank, "h", "n", 1.0, 0.1, 10.0 if past else 1.0, 0.5 if past else 0.0, past)


@given(st.integers(1, 5), st.lists(st.lists(st.booleans(), min_size=3, max_size=3), max_size=40))
def test_flagged_once_per_streak_of_n_windows(n: int, windows: list[list[bool]]) -> None:
    """A rank is flagged exactly when its run of past windows reaches ``n``, once per run."""
    f = Flagger(n)
    streak = [0, 0, 0]
    for w in windows:
        flagged = {s.rank for s in f.feed([_score(r, p) for r, p in enumerate(w)])}
        for r, p in enumerate(w):
            streak[r] = streak[r] + 1 if p else 0
        assert flagged == {r for r in range(3) if streak[r] == n}


def test_fewer_than_two_ranks_are_not_scored() -> None:
    assert score_window([RankWindow(0, 5, 5.0)], 1.0, 1.5) == []
    assert score_window([RankWindow(0, 5, 5.0), RankWindow(1, 0, 0.0)], 1.0, 1.5) == []


# -- real jobs --------------------------------------------------------------------------------
def _job(tmp_path: Path, *script_args: str, extra: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    events = tmp_path / "events.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICTK_", "PET_"))}
    proc = subprocess.run(
        [*RUN, "--standalone", "--nproc-per-node", "3", "--straggler-action", "report",
         "--straggler-interval", "0.5", "--straggler-windows", "2", "--event-log", str(events),
         *extra, str(LOOP), *script_args],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    lines = [json.loads(x) for x in events.read_text().splitlines()] if events.exists() else []
    return proc, [e for e in lines if e["kind"] == "straggler"]


def test_a_slow_rank_is_named(tmp_path: Path) -> None:
    """Rank 1 spends 60 ms more of its own per step than ranks 0 and 2 (~20 ms): the leader
    names it within a few windows, in an event and one log line with its host and slowdown."""
    proc, named = _job(tmp_path, "--steps", "30", "--slow-rank", "1", "--slow", "0.06")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert named, f"no straggler event; stderr:\n{proc.stderr[-3000:]}"
    assert {e["fields"]["rank"] for e in named} == {1}
    f = named[0]["fields"]
    assert f["slowdown"] >= 1.5 and f["host"] and f["straggler_node"]
    line = next(x for x in proc.stderr.splitlines() if "straggler: rank 1 on host" in x)
    assert "slower than the others' median" in line


def test_a_slow_rank_is_named_under_ddp(tmp_path: Path) -> None:
    """DDP's all-reduces run in C++ inside backward(): with a DDP module, backward counts as
    blocked, so the rank slow before it (rank 2 here) is named all the same."""
    proc, named = _job(tmp_path, "--steps", "30", "--slow-rank", "2", "--slow", "0.06", "--ddp")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {e["fields"]["rank"] for e in named} == {2}, proc.stderr[-3000:]


def test_no_straggler_without_a_slow_rank(tmp_path: Path) -> None:
    proc, named = _job(tmp_path, "--steps", "50")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert named == []
    assert "straggler:" not in proc.stderr


def test_bad_straggler_flags_are_one_line(tmp_path: Path) -> None:
    for flags, needle in ((["--straggler-action", "exclude", "--recovery", "in-place"], "--recovery"),
                          (["--straggler-action", "loud"], "--straggler-action"),
                          (["--straggler-threshold", "0.5"], "more than 1"),
                          (["--straggler-windows", "0"], "--straggler-windows")):
        proc = subprocess.run([*RUN, "--standalone", *flags, str(LOOP)], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == 2, (flags, proc.stderr)
        assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) <= 3, proc.stderr


# -- the chaos invariant ----------------------------------------------------------------------
PLAIN = ROOT / "tests" / "helpers" / "plain_allreduce.py"


def test_chaos_names_the_slow_rank_and_no_other(tmp_path: Path) -> None:
    """A real elastictk-chaos run: rank 1 of 3 pauses 2 s once (slow:2 at step 10); the
    invariant holds: rank 1 is named within its bound, ranks 0 and 2 never are."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"schema": "elastictk.fault-plan/1", "faults": [
        {"kind": "slow:2", "target": "rank:1", "at_step": 10}]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICTK_", "PET_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "elastictk.chaos", "--plan", str(plan), "--report-dir", str(tmp_path / "r"),
         "--timeout", "90", "--", "--nproc-per-node", "3", "--straggler-action", "report",
         "--straggler-interval", "1", "--straggler-windows", "1", str(PLAIN), "--steps", "80"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "[ok] every slow rank named a straggler, no other" in out, out[-3000:]
    assert proc.returncode == 0, out[-3000:]
    [row] = json.loads((tmp_path / "r" / "chaos-report.json").read_text())["faults"]
    assert 0 < row["detected_after"] <= 2 + 3 * 1, row  # the row says when it was named

def _ev(kind: str, mono: float, **fields: object) -> SimpleNamespace:
    return SimpleNamespace(kind=kind, mono=mono, fields=fields)


def _rec(events: list[SimpleNamespace], argv: list[str], ended: float = 200.0) -> SimpleNamespace:
    return SimpleNamespace(argv=argv, started=100.0, ended=ended, events=events)


ON = ["elastictk-run", "--straggler-action", "report", "--straggler-interval=1", "--straggler-windows", "1"]


def _slow(rank: int, at: float = 5.0) -> FaultRow:
    return FaultRow(0, "slow:2", f"rank:{rank}", "step 10", True, False, injected_at=at)


def test_chaos_check_passes_when_the_slow_rank_is_named() -> None:
    [c] = _stragglers([_slow(1)], _rec([_ev("straggler", 106.0, rank=1)], ON))  # type: ignore[arg-type]
    assert c.ok, c.detail


def test_chaos_check_fails_when_it_is_not_named_in_time_or_another_is() -> None:
    late = _rec([_ev("straggler", 100.0 + 5 + 2 + 3 + 1, rank=1)], ON)
    [c] = _stragglers([_slow(1)], late)  # type: ignore[arg-type]
    assert not c.ok and "not named a straggler within 5s" in c.detail
    [c] = _stragglers([_slow(1)], _rec([_ev("straggler", 106.0, rank=2)], ON))  # type: ignore[arg-type]
    assert not c.ok and "rank(s) 2 named a straggler but no slow fault hit them" in c.detail
    [c] = _stragglers([], _rec([_ev("straggler", 106.0, rank=0)], ON))  # type: ignore[arg-type]
    assert not c.ok  # a fault-free run names none
    [c] = _stragglers([_slow(1)], _rec([], ON, ended=107.0))  # type: ignore[arg-type]
    assert c.ok and "#0 not judged: the job ended within its bound" in c.detail


def test_chaos_check_only_for_runs_that_look() -> None:
    assert _stragglers([_slow(1)], _rec([], ["elastictk-run", "x.py"])) == []  # type: ignore[arg-type]
    assert straggler_settings(ON) == (1.0, 1)
    assert straggler_settings(["--straggler-action=report"]) == (5.0, 3)


def test_the_gauge_follows_the_event_and_clears_on_a_new_attempt() -> None:
    from prometheus_client import CollectorRegistry

    from elastictk.metrics.agent_metrics import AgentMetrics
    from elastictk.metrics.kinds import EventKind

    reg = CollectorRegistry()
    m = AgentMetrics(reg, job="j", node="n0")
    labels = {"run_id": "j", "node": "n0", "role": "default", "straggler_node": "n1"}
    m(EventKind.STRAGGLER, rank=3, host="h", straggler_node="n1", slowdown=3.5)
    assert reg.get_sample_value("elastictk_straggler_slowdown", labels) == 3.5
    m(EventKind.WORKERS_STARTED, pids={0: 1})
    assert reg.get_sample_value("elastictk_straggler_slowdown", labels) is None

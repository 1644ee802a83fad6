"""The learned hang judge's pure decision (elastictk/agent/hangjudge.py), the agent's reading of
worker-written progress words (elastictk/agent/learned.py: garbage from a worker is never an
error), and the worker side of the marks (elastictk.section, fault_point) in one process."""
from __future__ import annotations

import dataclasses
import math
import os

import pytest
from hypothesis import given, settings, strategies as st

from elastictk.agent.hangjudge import RankView, judge
from elastictk.agent.learned import Learned
from elastictk.agent.pace import FLOOR, Pace
from elastictk.metrics.layout import BUCKETS, GAPS, SlotSnapshot

NOW = 1000.0
views = st.builds(
    RankView, local_rank=st.integers(0, 7), rank=st.integers(0, 63),
    last=st.floats(NOW - 400, NOW), coll_since=st.one_of(st.just(0.0), st.floats(NOW - 400, NOW)),
    section=st.sampled_from(["", "eval", "save"]), state=st.sampled_from(["R", "S", "D", "T", "t"]),
    busy=st.booleans(), finished=st.booleans())


def _pace(deadline_samples: float) -> Pace:
    pace = Pace(ceiling=300)
    pace.add("progress", [deadline_samples] * 40)
    pace.add("section:eval", [60.0] * 40)
    return pace


@settings(max_examples=300, deadline=None)
@given(st.lists(views, min_size=1, max_size=8, unique_by=lambda v: v.local_rank),
       st.floats(0.001, 200))
def test_only_a_due_rank_is_ever_named_and_a_stall_is_every_rank(vs: list[RankView], pace_s: float) -> None:
    pace = _pace(pace_s)
    verdict, wait = judge(NOW, vs, pace)
    assert wait > 0
    by = {v.local_rank: v for v in vs}
    if verdict is None:
        return
    due = {v.local_rank for v in vs if not v.finished
           and NOW - v.last >= max(FLOOR, pace.deadline("progress"), 0)}
    for lr in verdict.local_ranks:
        v = by[lr]
        assert not v.finished
        limit = pace.deadline("progress")
        if v.section:
            limit = max(limit, pace.deadline(f"section:{v.section}"))
        assert NOW - v.last >= limit  # never before its own deadline
    if verdict.kind == "hung":
        for lr in verdict.local_ranks:
            v = by[lr]
            # named only when stopped, or idle outside a collective while a peer waits in one
            assert v.state in ("T", "t") or (
                v.coll_since == 0 and not v.busy and any(p.coll_since > 0 for p in vs if not p.finished))
    else:
        assert verdict.kind == "stalled"
        assert set(verdict.local_ranks) == {v.local_rank for v in vs if not v.finished}
    assert due or verdict.local_ranks


def test_the_failing_sides() -> None:
    pace = _pace(0.05)  # the floor
    waiting = RankView(0, 0, NOW - 6, NOW - 6, "", "S", False, False)
    idle = RankView(1, 1, NOW - 6, 0.0, "", "S", False, False)
    verdict, _ = judge(NOW, [waiting, idle], pace)
    assert verdict is not None and (verdict.kind, verdict.local_ranks) == ("hung", (1,))
    busy = RankView(1, 1, NOW - 6, 0.0, "", "R", True, False)  # computing: reported, not killed
    verdict, _ = judge(NOW, [waiting, busy], pace)
    assert verdict is not None and verdict.kind == "stalled" and "still compute" in verdict.reason
    in_eval = RankView(1, 1, NOW - 6, 0.0, "eval", "S", False, False)  # its section's deadline
    assert judge(NOW, [waiting, in_eval], pace)[0] is None
    fresh = RankView(1, 1, NOW - 4, 0.0, "", "S", False, False)  # not due yet: the floor
    assert judge(NOW, [waiting, fresh], pace)[0] is None
    both_idle = [RankView(0, 0, NOW - 6, 0.0, "", "S", False, False), idle]
    verdict, _ = judge(NOW, both_idle, pace)
    assert verdict is not None and verdict.kind == "stalled" and verdict.local_ranks == (0, 1)
    stopped = RankView(1, 1, NOW - 6, NOW - 7, "", "T", False, False)
    verdict, _ = judge(NOW, [waiting, stopped], pace)
    assert verdict is not None and (verdict.kind, verdict.local_ranks) == ("hung", (1,))


words = st.one_of(st.integers(0, 2 ** 64 - 1), st.integers(-(2 ** 63), -1))
doubles = st.floats(allow_nan=True, allow_infinity=True)
slots = st.builds(
    SlotSnapshot, local_rank=st.integers(0, 3), steps=words, last_step_mono=doubles,
    buckets=st.lists(words, min_size=BUCKETS, max_size=BUCKETS).map(tuple),
    progress_mono=doubles, coll_since=doubles, section_since=doubles, section=st.text(max_size=40),
    sections_done=words, section_last_s=doubles, section_last=st.text(max_size=40),
    gaps=st.lists(words, min_size=GAPS, max_size=GAPS).map(tuple))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(slots, min_size=1, max_size=4), min_size=1, max_size=4))
def test_garbage_progress_words_never_raise_nor_leave_the_bounds(looks: list[list[SlotSnapshot]]) -> None:
    """A worker writes its slot: whatever it wrote, the agent's look decides within the floor
    and the ceiling and never raises (the fuzzer for this reader of outside bytes)."""
    learned = Learned(ceiling=60.0)
    ranks = {lr: (lr, os.getpid(), NOW - 10) for lr in range(4)}
    for look in looks:
        slots_ = [SlotSnapshot(i) for i in range(4)]
        for s in look:
            slots_[s.local_rank] = s
        verdict, wait, _ = learned.look(NOW, ranks, slots_)
        assert wait > 0 and not math.isnan(wait)
        for kind, d in learned.pace.snapshot().items():
            assert min(FLOOR, 60.0) <= d <= 60.0, (kind, d)


def test_a_section_and_a_fault_point_are_progress_in_the_slot(monkeypatch: object) -> None:
    import elastictk
    from elastictk.faults.inworker import fault_point
    from elastictk.metrics import blocked, marks, worker
    from elastictk.metrics.steps import WorkerStepsBlock
    from elastictk.timer.marksink import not_in_collective

    with WorkerStepsBlock(1) as block:
        os.environ["ELASTICTK_METRICS_SHM"] = block.path
        try:
            worker._after_fork_in_child()  # a fresh process's state
            worker._state = worker._UNKNOWN
            assert worker.activate_from_env({**block.env(), marks.ENV_MARKS: "1"})
            before = block.snapshot()[0]
            with elastictk.section("eval"):
                inside = block.snapshot()[0]
            after = block.snapshot()[0]
            fault_point(1)
            last = block.snapshot()[0]
            marks.collective_entered()
            waiting = block.snapshot()[0]
            not_in_collective()  # the hang-in-collective fault: a rank that never arrived
            never_arrived = block.snapshot()[0]
        finally:
            del os.environ["ELASTICTK_METRICS_SHM"]
            worker._after_fork_in_child()
            blocked.untime_collectives()
            worker.deactivate()
            marks._enabled = False
            marks.set_sink(None)
    assert inside.section == "eval" and inside.section_since > 0
    assert inside.progress_count == before.progress_count + 1
    assert after.section_since == 0 and after.sections_done == 1 and after.section_last == "eval"
    assert after.section_last_s >= 0 and after.progress_count == before.progress_count + 2
    assert last.progress_count == after.progress_count + 1 and last.progress_mono >= after.progress_mono
    assert waiting.coll_since > 0 and never_arrived.coll_since == 0


def test_a_rank_with_no_progress_since_its_start_is_not_judged() -> None:
    """A replacement starting in place (and the ranks that wait for it to re-form) is a
    start-up, not a hang: not judged until it progresses (``--startup-timeout`` covers it)."""
    learned = Learned(ceiling=None)
    old, new = SlotSnapshot(0, progress_mono=NOW - 30), SlotSnapshot(1, progress_mono=NOW - 1)
    views_ = learned.views(NOW, {0: (0, os.getpid(), NOW - 10), 1: (1, os.getpid(), NOW - 10)}, [old, new])
    assert [v.finished for v in views_] == [True, False]


def test_a_runnable_rank_starved_of_cpu_is_computing_not_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a host whose cores are all busy a rank in a long step gets little CPU; it is runnable
    (R), so it reads as computing and is never judged idle beside a peer that waits; one in disk
    I/O (D, a checkpoint on slow storage) too. A sleeping rank (S) that used no CPU is idle."""
    from elastictk.agent import learned as learned_mod
    from elastictk.lifetime.procfs import read_stat as real_read_stat

    states = {100: "R", 200: "S", 300: "D"}
    monkeypatch.setattr(learned_mod, "cpu_seconds", lambda pid: 1.0)  # no CPU between looks

    def fake_stat(pid: int) -> object:
        st = real_read_stat(os.getpid())
        assert st is not None
        return dataclasses.replace(st, state=states[pid])

    monkeypatch.setattr(learned_mod, "read_stat", fake_stat)
    learned = Learned(ceiling=None)
    slots = [SlotSnapshot(0, progress_mono=NOW - 30), SlotSnapshot(1, progress_mono=NOW - 30)]
    slots.append(SlotSnapshot(2, progress_mono=NOW - 30))
    ranks = {0: (0, 100, NOW - 60), 1: (1, 200, NOW - 60), 2: (2, 300, NOW - 60)}
    learned.views(NOW - 1, ranks, slots)
    runnable, sleeping, writing = learned.views(NOW, ranks, slots)
    assert runnable.busy and runnable.state == "R"
    assert writing.busy and writing.state == "D"
    assert not sleeping.busy and sleeping.state == "S"

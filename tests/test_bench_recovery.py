"""The recovery benchmark reads the job's output correctly, however the ranks' lines interleave."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench._recovery_job import Timeline, parse_line


def _feed(chunks: list[str]) -> Timeline:
    """What the reader thread does: split the byte stream into lines, one timestamp each."""
    tl = Timeline()
    for t, line in enumerate("".join(chunks).split("\n")):
        parse_line(tl, float(t), line)
    return tl


def _writes(rank: int, lines: list[str]) -> list[str]:
    """``python -u`` print: the text and the newline are two writes."""
    out: list[str] = []
    for line in lines:
        out += [f"[rank {rank}] {line}", "\n"]
    return out


@st.composite
def interleavings(draw: st.DrawFn) -> tuple[int, list[str]]:
    """Two attempts of a ``world``-rank job whose writes interleave arbitrarily per attempt."""
    world = draw(st.integers(1, 4))
    chunks: list[str] = []
    for attempt, steps in ((0, range(1, 5)), (1, range(4, 7))):
        per_rank = []
        for r in range(world):
            lines = [f"resumed at step 3 (attempt {attempt})"] if attempt else []
            lines += [f"step {s} loss 1.{r}" for s in steps]
            per_rank.append(_writes(r, lines))
        while any(per_rank):
            r = draw(st.sampled_from([i for i, w in enumerate(per_rank) if w]))
            chunks.append(per_rank[r].pop(0))
    chunks.append("final checksum abc123 after 6 steps\n")
    return world, chunks


@settings(suppress_health_check=[HealthCheck.too_slow])  # drawing interleavings is slow on a busy host
@given(interleavings())
def test_every_rank_is_found_in_glued_lines(case: tuple[int, list[str]]) -> None:
    world, chunks = case
    tl = _feed(chunks)
    assert set(tl.first_step) == set(range(world))
    assert tl.last_step == {r: 6 for r in range(world)}
    assert tl.recovered(world)
    assert {r: a for r, (_, _, a) in tl.resumed.items()} == {r: 1 for r in range(world)}
    # The first step after resuming is the checkpoint's next step, never a step of attempt 0.
    assert {r: s for r, (_, s) in tl.step_after_resume.items()} == {r: 4 for r in range(world)}
    assert tl.final is not None and tl.final[1:] == ("abc123", 6)


def test_a_later_attempt_supersedes_one_that_failed_before_its_first_step() -> None:
    tl = Timeline()
    for t, line in enumerate([
        "[rank 0] step 4 loss 1.0", "[rank 1] step 4 loss 1.0",
        "[rank 0] resumed at step 3 (attempt 1)", "[rank 0] step 4 loss 1.0",
        "[rank 1] resumed at step 3 (attempt 1)",  # rank 1 dies here; attempt 2 follows
        "[rank 1] resumed at step 3 (attempt 2)", "[rank 1] step 4 loss 1.0",
    ]):
        parse_line(tl, float(t), line)
    assert not tl.recovered(2)  # rank 0 stepped in attempt 1, rank 1 in attempt 2
    parse_line(tl, 7.0, "[rank 0] resumed at step 3 (attempt 2)")
    assert not tl.recovered(2)
    parse_line(tl, 8.0, "[rank 0] step 4 loss 1.0")
    assert tl.recovered(2) and tl.step_after_resume == {0: (8.0, 4), 1: (6.0, 4)}


def test_agent_events_and_torchrun_failure_lines_are_kept() -> None:
    tl = Timeline()
    parse_line(tl, 1.0, "[elastictk-run] worker_failed rank=1 local_rank=1 exit=SIGKILL")
    parse_line(tl, 2.0, "[elastictk-run] workers_started attempt=1 pids={0: 10, 1: 11}")
    parse_line(tl, 3.0, "E1121 api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 5)")
    assert tl.agent_event("worker_failed") == (1.0, "rank=1 local_rank=1 exit=SIGKILL")
    assert tl.agent_event("worker_failed", after=1.5) is None
    assert tl.agent_event("workers_started", after=1.5) == (2.0, "attempt=1 pids={0: 10, 1: 11}")
    ev = tl.agent_event("torch_worker_failed")
    assert ev is not None and ev[0] == 3.0

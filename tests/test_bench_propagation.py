"""The propagation benchmark's parts that decide what counts: the output parser and the pidfd
exit watch. The benchmark itself runs three launchers per launch (minutes), so its quick mode is
left to the benchmark runner; these check its reading of the lines and of process exits."""
from __future__ import annotations

import signal
import subprocess
import sys

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench._propagation_job import ExitWatch, Timeline
from bench.common import BenchError

RANKS = st.integers(0, 5)


def _feed(lines: list[str]) -> Timeline:
    tl = Timeline()
    for i, line in enumerate(lines):
        tl.parse(i % 3, float(i), line)
    return tl


@given(st.lists(st.tuples(RANKS, st.integers(1, 99)), min_size=1, max_size=12))
def test_glued_step_lines_each_count(steps: list[tuple[int, int]]) -> None:
    # python -u writes a line's text and its newline separately: ranks' lines can share a line.
    glued = "".join(f"[rank {r}] step {s} loss 1.0" for r, s in steps)
    tl = _feed([glued])
    assert [(r, s) for _, r, s in tl.steps] == steps
    for r in {r for r, _ in steps}:
        assert tl.last_step[r] == max(s for rr, s in steps if rr == r)


def test_first_step_counts_only_after_the_last_resume() -> None:
    lines = [
        "[rank 0] step 4 loss 1.0",  # t=0: the killed attempt
        "[rank 1] step 4 loss 1.0",  # t=1
        "[rank 0] resumed at step 3 (attempt 1)",  # t=2: an attempt that failed again
        "[rank 0] step 4 loss 1.0",  # t=3
        "[rank 1] resumed at step 3 (attempt 1)",  # t=4
        "[rank 0] resumed at step 3 (attempt 2)",  # t=5: the attempt that ran to the end
        "[rank 1] resumed at step 3 (attempt 2)",  # t=6
        "[rank 1] step 4 loss 1.0[rank 0] step 4 loss 1.0",  # t=7
    ]
    tl = _feed(lines)
    assert tl.first_step_of_last_attempt(2, after=0.5) == {0: 7.0, 1: 7.0}
    assert _feed(lines[:6]).first_step_of_last_attempt(2, after=0.5) is None


def test_agent_events_of_both_launchers_are_recognised() -> None:
    tl = _feed([
        "[elastictk-run] worker_failed rank=5 local_rank=1 exit=SIGKILL first_in_job=True",
        "[elastictk-run] peer_failed by=node-a",
        "I1121 14:23:43.825000 1 torch/distributed/elastic/agent/server/api.py:942] "
        "[default] Worker group FAILED. 3/3 attempts left; will restart worker group",
        "I1121 14:23:45.012000 1 api.py:962] [default] Detected 1 new nodes from group_rank=0; "
        "will restart worker group",
        "final checksum 61d5f2f515fb0048 after 40 steps",
    ])
    assert [(n, name) for _, n, name, _ in tl.events] == [
        (0, "worker_failed"), (1, "peer_failed"), (2, "torch_group_failed"),
        (0, "torch_peer_waiting")]
    assert tl.event("peer_failed") == (1.0, 1, "by=node-a")
    assert [(c, s) for _, c, s in tl.finals] == [("61d5f2f515fb0048", 40)]


def test_exit_watch_times_each_exit_and_signals_by_pidfd() -> None:
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(2)]
    try:
        watch = ExitWatch({r: psutil.Process(p.pid) for r, p in enumerate(procs)})
        try:
            t0 = watch.send(0, signal.SIGKILL)
            assert procs[0].wait(30) == -signal.SIGKILL
            assert not watch.wait_all(0.2), "rank 1 still runs"
            procs[1].terminate()
            assert watch.wait_all(30)
            assert set(watch.exited) == {0, 1} and watch.exited[0] >= t0
        finally:
            watch.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_exit_watch_refuses_a_process_that_is_gone() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    proc = psutil.Process(p.pid)
    p.wait()
    with pytest.raises(BenchError, match="gone|exited"):
        ExitWatch({0: proc})

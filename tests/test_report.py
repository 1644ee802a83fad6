"""The failure report over real worker processes, real logs and real (and broken) error files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.supervisor.errors import ERROR_FILE_ENV, read_error_file, record_exception
from elastictk.supervisor.report import (
    MAX_TAIL_LINES,
    FailureReport,
    WorkerExit,
    describe_exit,
    pick_tail,
)
from elastictk.supervisor.report_text import WorkerGroupFailed, render_text

TIMEOUT = 120

SCRIPT = """
import sys, elastictk

def crash():
    import ctypes
    ctypes.string_at(0)

@elastictk.record
def main():
    print("starting rank", sys.argv[2], file=sys.stderr)
    mode = sys.argv[1]
    if mode == "raise":
        raise ValueError("loss is nan at step 7")
    if mode == "segv":
        crash()
    if mode == "noisy":
        for i in range(100):
            print("log line", i, file=sys.stderr)
        sys.exit(5)

if __name__ == "__main__":
    main()
"""


def run(tmp_path: Path, mode: str, rank: int) -> WorkerExit:
    """One real worker with stderr captured to a file, as the worker group runs it."""
    d = tmp_path / f"rank{rank}"
    d.mkdir()
    script = tmp_path / "worker.py"
    if not script.exists():
        script.write_text(SCRIPT)
    env = dict(os.environ, **{ERROR_FILE_ENV: str(d / "error.json")})
    env.pop("PYTHONFAULTHANDLER", None)
    with open(d / "stdout.log", "wb") as out, open(d / "stderr.log", "wb") as err:
        started = time.monotonic()
        p = subprocess.Popen([sys.executable, str(script), mode, str(rank)], env=env,
                             stdout=out, stderr=err)
        try:
            code = p.wait(TIMEOUT)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        ended = time.monotonic()
    return WorkerExit(local_rank=rank, rank=rank, pid=p.pid, exitcode=code, started_at=started,
                      ended_at=ended, stdout_path=str(d / "stdout.log"),
                      stderr_path=str(d / "stderr.log"), error_file=str(d / "error.json"))


def at(w: WorkerExit, ended: float) -> WorkerExit:
    """The same worker with a chosen end time (ordering is a property of data, not of luck)."""
    return WorkerExit(**{**w.__dict__, "started_at": 0.0, "ended_at": ended})


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, WorkerExit]:
    tmp = tmp_path_factory.mktemp("workers")
    return {"ok": run(tmp, "ok", 0), "raise": run(tmp, "raise", 1), "segv": run(tmp, "segv", 2),
            "noisy": run(tmp, "noisy", 3)}


def test_exit_descriptions() -> None:
    assert describe_exit(-11) == "SIGSEGV (signal 11)"
    assert describe_exit(None, 9) == "SIGKILL (signal 9)"
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(139) == "exit code 139 (128+11: SIGSEGV (signal 11) via a shell?)"
    assert describe_exit(-99) == "signal 99"
    assert describe_exit(None) == "still running"


def test_root_cause_is_the_first_to_end(workers: dict[str, WorkerExit]) -> None:
    results = [at(workers["ok"], 1.0), at(workers["raise"], 5.0), at(workers["segv"], 3.0),
               at(workers["noisy"], 4.0)]
    report = FailureReport.build(results, hostname="node-a", wall_offset=1_700_000_000.0)
    assert [f.rank for f in report.failures] == [2, 3, 1]
    root = report.root_cause
    assert root is not None and root.rank == 2
    assert root.exit_description == "SIGSEGV (signal 11)" and root.error_code == -11
    assert root.ended_wall == 1_700_000_003.0
    assert report.headline() == ("worker group failed: 3 of 4 workers; "
                                 "first: rank 2's SIGSEGV (signal 11)")
    text = render_text(report)
    assert "exited     : SIGSEGV (signal 11)" in text
    assert "killed by a signal before Python could record" in text
    # The faulthandler dump from the real crash is shown from its header, with our frame in it.
    assert "    | Fatal Python error: Segmentation fault" in text
    assert "in crash" in text
    assert "rank 1 (local_rank 1, pid" in text and "ValueError: loss is nan at step 7, +2.00s" in text
    assert "rank 3 (local_rank 3, pid" in text and "exit code 5, +1.00s" in text


def test_exception_traceback_comes_from_the_error_file(workers: dict[str, WorkerExit]) -> None:
    report = FailureReport.build([workers["ok"], workers["raise"]], hostname="node-a")
    root = report.root_cause
    assert root is not None and root.rank == 1 and root.exit_description == "exit code 1"
    assert root.error is not None and root.error.message == "ValueError: loss is nan at step 7"
    assert root.stderr_tail == ()  # the traceback is enough; the log was not read
    text = render_text(report)
    assert f"error file : {workers['raise'].error_file}" in text
    assert "exception  : ValueError: loss is nan at step 7" in text
    assert "    Traceback (most recent call last):" in text and "in main" in text
    assert root.cause() == "rank 1's ValueError: loss is nan at step 7"


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated"])
def test_broken_error_file_falls_back_to_stderr(workers: dict[str, WorkerExit], tmp_path: Path,
                                                damage: str) -> None:
    src = workers["raise"]
    assert src.error_file is not None
    blob = Path(src.error_file).read_bytes()
    broken = tmp_path / "error.json"
    broken.write_bytes({"garbage": b"\x89PNG\r\n", "empty": b"",
                        "truncated": blob[: len(blob) // 3]}[damage])
    w = WorkerExit(**{**src.__dict__, "error_file": str(broken)})
    report = FailureReport.build([w], hostname="h")
    root = report.root_cause
    assert root is not None and root.error is None
    assert root.error_file_problem is not None and str(broken) in root.error_file_problem
    # The uncaught exception also went to stderr, and the (short) log is shown whole.
    assert root.stderr_tail[:2] == ("starting rank 1", "Traceback (most recent call last):")
    assert root.stderr_tail[-1] == "ValueError: loss is nan at step 7"
    text = render_text(report)
    assert f"error file {broken} is unreadable" in text and "showing stderr instead" in text
    assert "    | ValueError: loss is nan at step 7" in text
    data = json.loads(json.dumps(report.to_json()))
    assert data["failures"][0]["error"] is None
    assert str(broken) in data["failures"][0]["error_file_problem"]


def test_no_error_file_shows_the_last_lines(workers: dict[str, WorkerExit]) -> None:
    report = FailureReport.build([workers["noisy"]], hostname="h")
    root = report.root_cause
    assert root is not None and root.error is None and root.error_file_problem is None
    assert root.stderr_tail == tuple(f"log line {i}" for i in range(80, 100))
    text = render_text(report)
    assert "decorate the entry point with @elastictk.record" in text
    assert f"last 20 lines of {workers['noisy'].stderr_path}" in text


def test_missing_logs_and_unset_error_file(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    gone = WorkerExit(local_rank=0, rank=4, pid=1, exitcode=None, signal=9, started_at=0.0,
                      ended_at=2.0, stderr_path=str(tmp_path / "nope.log"))
    piped = WorkerExit(local_rank=2, rank=6, pid=3, exitcode=1, started_at=0.0, ended_at=4.0,
                       stderr_path=str(fifo))
    uncaptured = WorkerExit(local_rank=1, rank=5, pid=2, exitcode=2, started_at=0.0, ended_at=3.0)
    report = FailureReport.build([gone, uncaptured, piped], hostname="h")
    a, b, c = report.failures
    assert c.stderr_problem == f"cannot read {fifo}: not a regular file"
    assert a.exit_description == "SIGKILL (signal 9)"
    assert a.stderr_problem is not None and "nope.log" in a.stderr_problem
    assert b.stderr_problem == "stderr was not captured to a file"
    text = render_text(report)
    assert "error file : not set for this worker" in text and "nope.log" in text


def test_successes_and_running_workers_are_not_failures() -> None:
    ok = WorkerExit(local_rank=0, rank=0, pid=1, exitcode=0, ended_at=1.0)
    running = WorkerExit(local_rank=1, rank=1, pid=2, exitcode=None)
    report = FailureReport.build([ok, running], hostname="h")
    assert report.failures == () and report.root_cause is None
    assert report.headline() == "worker group failed: no worker failed"


def test_workers_stopped_by_the_supervisor_are_never_the_root_cause() -> None:
    term = WorkerExit(local_rank=0, rank=0, pid=1, exitcode=-15, ended_at=1.0)
    real = WorkerExit(local_rank=1, rank=1, pid=2, exitcode=1, ended_at=2.0)
    report = FailureReport.build([term, real], hostname="h", stopped=[0])
    assert [f.rank for f in report.failures] == [1, 0]
    assert "SIGTERM (signal 15), -1.00s, stopped by the supervisor" in render_text(report)


def test_worker_groups_own_result_type(workers: dict[str, WorkerExit]) -> None:
    spec = pytest.importorskip("elastictk.supervisor.spec")
    seg, term = workers["segv"], workers["noisy"]
    results = [spec.WorkerResult(local_rank=w.local_rank, rank=w.rank, role_rank=w.rank,
                                 role="default", attempt=0, pid=w.pid, exitcode=code,
                                 started_at=0.0, ended_at=end, stderr_path=w.stderr_path,
                                 error_file=w.error_file, stopped=stopped)
               for w, code, end, stopped in ((term, -15, 1.0, True), (seg, -11, 2.0, False))]
    report = FailureReport.build(results, hostname="h")
    assert [(f.rank, f.exit_description, f.stopped_by_supervisor) for f in report.failures] == [
        (2, "SIGSEGV (signal 11)", False), (3, "SIGTERM (signal 15)", True)]


def test_json_round_trip(workers: dict[str, WorkerExit]) -> None:
    report = FailureReport.build(list(workers.values()), hostname="node-a",
                                 wall_offset=1.7e9, restart_count=2)
    data = json.loads(json.dumps(report.to_json()))
    again = FailureReport.from_json(data)
    assert again == report
    assert again.to_json() == data
    assert render_text(again) == render_text(report)
    assert data["failures"][0]["exit"] in {"SIGSEGV (signal 11)", "exit code 1", "exit code 5"}
    with pytest.raises(ValueError, match="not an elastictk failure report"):
        FailureReport.from_json({"schema": "something else"})
    with pytest.raises(ValueError, match="not an elastictk failure record"):
        FailureReport.from_json({**data, "failures": [{"rank": "x"}]})


def test_collect_reads_host_and_clock(workers: dict[str, WorkerExit]) -> None:
    report = FailureReport.collect([workers["segv"]])
    root = report.root_cause
    assert root is not None and root.ended_wall is not None
    assert abs(root.ended_wall - time.time()) < 3600 and report.hostname


# ---------------------------------------------------------------- a launcher under @record
def test_nested_launcher_passes_the_workers_error_file_upward(
        workers: dict[str, WorkerExit], tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    report = FailureReport.build([workers["raise"]], hostname="h")
    parent = tmp_path / "parent.json"
    assert record_exception(WorkerGroupFailed(report), str(parent))
    up = json.loads(parent.read_text())
    assert workers["raise"].error_file is not None
    child = json.loads(Path(workers["raise"].error_file).read_text())
    assert up["message"]["errorCode"] == 1
    del up["message"]["errorCode"]
    assert up == child  # the worker's own traceback, as torch's ChildFailedError copies it
    theirs = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(parent))
    assert isinstance(theirs.message, dict)
    assert theirs.message["message"] == "ValueError: loss is nan at step 7"


def test_nested_launcher_synthesizes_a_file_for_a_signal(
        workers: dict[str, WorkerExit], tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    report = FailureReport.build([workers["segv"]], hostname="h", wall_offset=1.7e9)
    parent = tmp_path / "parent.json"
    assert record_exception(WorkerGroupFailed(report), str(parent))
    rec = read_error_file(str(parent))
    assert rec is not None and rec.error_code == -11
    assert rec.message.startswith("rank 2's SIGSEGV (signal 11) (pid ")
    assert rec.traceback is not None and "Fatal Python error: Segmentation fault" in rec.traceback
    theirs = ProcessFailure(local_rank=0, pid=1, exitcode=-11, error_file=str(parent))
    assert theirs.timestamp == int(1.7e9 + report.failures[0].ended_at)


# ---------------------------------------------------------------- tail selection (pure)
lines_st = st.lists(st.sampled_from(["x", "y = 1", "", "Traceback (most recent call last):",
                                     "Fatal Python error: Aborted", "  File \"a.py\", line 1"]),
                    max_size=150)


@given(lines_st, st.integers(min_value=1, max_value=40))
@settings(max_examples=300)
def test_tail_is_a_bounded_slice_of_the_log(lines: list[str], n: int) -> None:
    tail = pick_tail(lines, n, MAX_TAIL_LINES)
    assert len(tail) <= max(n, MAX_TAIL_LINES)
    stripped = list(lines)
    while stripped and not stripped[-1].strip():
        stripped.pop()
    # A contiguous slice, and it holds at least the last min(n, len) lines unless a marker
    # moved the window up (then it starts at that marker).
    text = "\n".join(stripped)
    assert "\n".join(tail) in text
    if tail and tail != stripped[-len(tail):]:
        assert tail[0].startswith(("Fatal Python error:", "Traceback (most recent call last):"))
    else:
        assert tail == stripped[-n:] or len(tail) >= n


def test_tail_prefers_a_fault_dump_header() -> None:
    log = ["noise"] * 10 + ["Fatal Python error: Segmentation fault", ""] + \
          [f"  File \"x.py\", line {i} in f" for i in range(30)] + ["Extension modules: z"]
    tail = pick_tail(log, 20)
    assert tail[0] == "Fatal Python error: Segmentation fault" and tail[-1] == "Extension modules: z"
    assert pick_tail(["a"] * 100 + ["b"], 3) == ["a", "a", "b"]

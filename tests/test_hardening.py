"""What a real run leaves on disk is private: log directories 0700, log files 0600, whatever the umask."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterator

import pytest

from elastictk.metrics.events import EventLog
from elastictk.supervisor.env import Assignment
from elastictk.supervisor.group import WorkerGroup
from elastictk.supervisor.logs import claim_run_dir, make_attempt_dir
from elastictk.supervisor.spec import Std, WorkerSpec, python_script_argv

# Rank 0 tee'd (through the pump, with a filter), rank 1 redirected; rank 1 fails under
# @elastictk.record so it writes its error file.
WORKER = """\
import os, sys
import elastictk

@elastictk.record
def main():
    rank = os.environ["LOCAL_RANK"]
    print("KEEP line from", rank, flush=True)
    print("to stderr", rank, file=sys.stderr, flush=True)
    if rank == "1":
        raise ValueError("failed on purpose")

main()
"""


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """umask 0: a mode left to the default would come out 0777/0666, not merely 0755/0644."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            out[str(path.relative_to(root))] = os.lstat(path).st_mode
    return out


def test_a_real_run_leaves_private_logs(tmp_path: Path, loose_umask: None) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    spec = WorkerSpec(python_script_argv(str(script)), local_world_size=2, tee=Std.ALL,
                      redirects=Std.ALL, local_ranks_filter=frozenset({0}),
                      duplicate_stdout_filters=("KEEP",))
    log_dir = tmp_path / "logs"
    assignment = Assignment.homogeneous(0, 1, 2, master_addr="127.0.0.1", master_port=29512,
                                        run_id="job", max_restarts=0)
    devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)  # the tee's console copy
    try:
        with WorkerGroup(spec, log_dir, console=(devnull, devnull)) as g:
            g.start(0, assignment)
            results = g.wait(timeout=120)
            g.stop()
            run_dir = g.run_log_dir
    finally:
        os.close(devnull)
    assert results[1].exitcode != 0 and results[0].exitcode == 0
    assert run_dir is not None
    with EventLog(run_dir / "events.jsonl") as events:
        events("worker_failed", rank=1)
    modes = _modes(run_dir)
    expected_files = {"attempt_0/0/stdout.log", "attempt_0/0/stderr.log", "attempt_0/1/stdout.log",
                      "attempt_0/1/stderr.log", "attempt_0/1/error.json", "attempt_0/filtered_stdout.log",
                      "events.jsonl"}
    assert expected_files <= set(modes), sorted(modes)
    assert "KEEP line from 0" in (run_dir / "attempt_0" / "filtered_stdout.log").read_text()
    assert stat.S_IMODE(os.stat(log_dir).st_mode) == 0o700  # created here, so private too
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    for name, mode in modes.items():
        if stat.S_ISDIR(mode):
            assert stat.S_IMODE(mode) == 0o700, name
        else:
            assert stat.S_ISREG(mode) and stat.S_IMODE(mode) == 0o600, name


def test_run_and_attempt_dirs_are_0700_exactly(tmp_path: Path) -> None:
    old = os.umask(0o277)  # would leave 0500 (unwritable) without the chmod
    try:
        run_dir = claim_run_dir(tmp_path / "logs", "job")
        again = claim_run_dir(tmp_path / "logs", "job")
        attempt = make_attempt_dir(run_dir, 0)
    finally:
        os.umask(old)
    for d in (run_dir, again, attempt):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert again.name == "job.1"


def test_an_existing_log_dir_keeps_its_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    run_dir = claim_run_dir(shared, "job")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755  # not ours to change
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700


def test_the_event_log_is_created_0600(tmp_path: Path, loose_umask: None) -> None:
    path = tmp_path / "new" / "events.jsonl"
    with EventLog(path) as log:
        log("a")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700

"""Workers read as what they are: a script worker forked from the preload server carries the
command line torchrun would have run for it (``/proc/<pid>/cmdline``, so ``ps`` and ``pgrep -f
script.py`` find it) and its script's name as ``/proc/<pid>/comm``; the preload server reads
``elastictk-run: preload server (job <id>)``. Compared with torchrun on the same script."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _launch(launcher: list[str], script: Path, tmp_path: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    """Start the job and wait until both workers wrote their pid file; (launcher, worker pids)."""
    marks = tmp_path / "marks"
    marks.mkdir(exist_ok=True)
    proc = subprocess.Popen([*launcher, "--standalone", "--nproc-per-node", "2", str(script), "--lr", "0.1",
                             str(marks)], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(list(marks.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc, sorted(int(p.name) for p in marks.iterdir())


def _stop(proc: subprocess.Popen[bytes], tmp_path: Path) -> None:
    (tmp_path / "go").touch()
    try:
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "titled_train.py"
    path.write_text("import os, sys, time\n"
                    "open(os.path.join(sys.argv[-1], str(os.getpid())), 'w').close()\n"
                    "while not os.path.exists('go'):\n    time.sleep(0.05)\n")
    return path


def _pgrep(pattern: str) -> set[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


@pytest.mark.skipif(shutil.which("pgrep") is None, reason="pgrep (procps) is not installed")
def test_preloaded_workers_carry_torchruns_command_line_and_their_script_name(
        tmp_path: Path, script: Path) -> None:
    proc, workers = _launch([sys.executable, "-m", "elastictk.run", "--log-dir", str(tmp_path / "logs")],
                            script, tmp_path)
    try:
        assert len(workers) == 2, "the workers did not start"
        for pid in workers:
            assert _cmdline(pid) == f"{sys.executable} -u {script} --lr 0.1 {tmp_path / 'marks'}"
            assert _comm(pid) == "titled_train.py"[:15]
        assert set(workers) <= _pgrep(script.name), "pgrep -f script.py does not find the workers"
        servers = [c for c in psutil.Process(proc.pid).children()
                   if _cmdline(c.pid).startswith("elastictk-run: preload server (job ")]
        assert len(servers) == 1, [_cmdline(c.pid) for c in psutil.Process(proc.pid).children()]
        assert _comm(servers[0].pid) == "et-preload"
    finally:
        _stop(proc, tmp_path)
    assert proc.returncode == 0


@pytest.mark.skipif(shutil.which("pgrep") is None, reason="pgrep (procps) is not installed")
def test_pgrep_finds_the_same_processes_as_under_torchrun(tmp_path: Path, script: Path) -> None:
    found = {}
    for name, launcher in (("torchrun", [sys.executable, "-m", "torch.distributed.run"]),
                           ("elastictk-run", [sys.executable, "-m", "elastictk.run"])):
        run_dir = tmp_path / name
        run_dir.mkdir()
        proc, workers = _launch(launcher, script, run_dir)
        try:
            matched = _pgrep(script.name)
            found[name] = (len(matched), sorted(_cmdline(p).split(" ", 1)[1].startswith("-u ")
                                                 for p in workers))
        finally:
            _stop(proc, run_dir)
    assert found["elastictk-run"] == found["torchrun"], found

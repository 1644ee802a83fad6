"""docs/quickstart.md as a user pastes it: every block, in order, in one directory.

Each python block is saved under the name its first comment gives and run with the command
that comment shows; §2's command runs as written while the test kills one of its workers with
SIGKILL, as the page tells the reader to, and sees the restart the page promises (then stops
the job, which would run another minute); §4's ``elastictk-chaos`` commands run on both
scripts and exit 0. The python blocks of this page are run here only (``test_docs.py`` skips
them): once, in the page's order, which is how a reader meets them.
"""
from __future__ import annotations

import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import psutil

from tests.test_docs import PROGRAMS, ROOT, Block, blocks, command, environment, shell_lines, words_of

PAGE = ROOT / "docs" / "quickstart.md"
TIMEOUT = 300  # one command, far past a loaded machine's
KILL_STEP = "--step-time"  # §2's command: the one a reader kills a worker of by hand


def _script_name(block: Block) -> tuple[str, list[str]]:
    """The file a python block is saved as, and the command its first comment shows."""
    header = next(line[2:] for line in block.text.splitlines() if line.startswith("# elastictk-run"))
    words = shlex.split(header)
    return next(w for w in words if w.endswith(".py")), words


def _run(words: list[str], cwd: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command(words), cwd=cwd, env=environment(tmp), capture_output=True, text=True,
                          timeout=TIMEOUT)


def _wait_line(path: Path, pattern: str, proc: subprocess.Popen[str], deadline: float) -> re.Match[str]:
    while True:
        m = re.search(pattern, path.read_text())
        if m is not None:
            return m
        assert proc.poll() is None, f"the job ended (exit {proc.returncode}) before {pattern!r}: {path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {pattern!r} in {TIMEOUT}s: {path.read_text()[-3000:]}"
        time.sleep(0.1)


def _kill_a_worker(words: list[str], cwd: Path, tmp: Path) -> None:
    """§2: run the command, SIGKILL local rank 1 (a process titled as the page says), see the
    rank named with its signal and every worker started again; then stop the job (SIGTERM)."""
    err = tmp / "kill-stderr.log"
    with open(err, "w") as stderr:
        proc = subprocess.Popen(command(words), cwd=cwd, env=environment(tmp), stdout=subprocess.DEVNULL,
                                stderr=stderr, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        m = _wait_line(err, r"workers_started attempt=0 .*pids=\{0: (\d+), 1: (\d+)\}", proc, deadline)
        victim = psutil.Process(int(m.group(2)))
        title = "-u " + " ".join(words[words.index("train.py"):])  # what the page's pgrep finds
        while title not in " ".join(victim.cmdline()):  # a forked worker titles itself as it starts
            assert time.monotonic() < deadline, f"local rank 1 never titled {title!r}: {victim.cmdline()}"
            time.sleep(0.1)
        victim.send_signal(signal.SIGKILL)
        _wait_line(err, r"worker_failed rank=1 .*exit=SIGKILL", proc, deadline)
        _wait_line(err, r"workers_started attempt=1 restart_count=1", proc, deadline)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, err.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_quickstart_runs_in_order_as_pasted(tmp_path: Path) -> None:
    cwd = tmp_path / "work"
    cwd.mkdir()
    ran: list[str] = []
    for block in blocks(PAGE):
        if block.lang == "python":
            name, words = _script_name(block)
            (cwd / name).write_text(block.text)
            r = _run(words, cwd, tmp_path)
            assert r.returncode == 0, f"{block.id}: `{shlex.join(words)}` exited {r.returncode}: {r.stderr[-3000:]}"
            ran.append(name)
            continue
        if block.lang != "bash":
            continue
        for line in shell_lines(block):
            words = words_of(line)
            if words[:2] == ["pip", "install"]:
                continue  # the install step: this checkout's venv is installed
            assert words[0] in PROGRAMS, f"{block.id}: `{line}` is neither an install nor an elastictk command"
            if KILL_STEP in words:
                _kill_a_worker(words, cwd, tmp_path)
                ran.append("kill")
                continue
            r = _run(words, cwd, tmp_path)
            assert r.returncode == 0, f"{block.id}: `{line}` exited {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
            ran.append(words[-1])
            if words[0] == "elastictk-chaos" and words[-1] == "train.py":  # no State: said, not failed
                assert "steps lost not judged for 2 fault(s)" in r.stdout, r.stdout
            if words[0] == "elastictk-chaos" and words[-1] == "train_state.py":  # judged whole
                assert "2 fault(s) planned, 2 fired" in r.stdout and \
                    "[ok] steps lost per fault <= the snapshot interval" in r.stdout, r.stdout
    assert ran == ["train.py", "kill", "train_state.py", "train.py", "train_state.py"], ran

"""elastictk-run forks its preload server from itself after its own torch import (torch imported
once per node, not twice): the forked server is what a fresh interpreter was to its workers,
dies with its owner, and a process that runs threads or holds CUDA starts a fresh one instead."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from elastictk.supervisor.forkserver import PreloadServer
from elastictk.supervisor.forkstart import can_fork

ROOT = Path(__file__).resolve().parent.parent

WORKER = """\
import json, logging, os, sys
fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
server = os.getppid()
with open(os.path.join(os.environ["OUT"], os.environ["RANK"] + ".json"), "w") as f:
    json.dump({"handlers": len(logging.getLogger("elastictk").handlers),
               "level": logging.getLogger("elastictk").level,
               "path": sys.path[:2], "torch": "torch" in sys.modules,
               "stdin": os.readlink("/proc/self/fd/0"),
               "server_sid": os.getsid(server), "server": server,
               "server_fds": sorted(os.readlink(f"/proc/{server}/fd/{x}")
                                    for x in os.listdir(f"/proc/{server}/fd"))}, f)
"""


def _run(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    script = tmp_path / "scripts" / "w.py"
    script.parent.mkdir()
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "ELASTICTK_LOG_LEVEL": "DEBUG"}
    done = subprocess.run([sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "2",
                           *flags, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


def test_elastictk_run_forks_its_server_and_workers_see_a_fresh_interpreters_world(tmp_path: Path) -> None:
    done, seen = _run(tmp_path)
    (line,) = [x for x in done.stderr.splitlines() if "preload server" in x]
    assert ": forked; preloads torch," in line, line
    for w in seen:
        assert w["handlers"] == 0 and w["level"] == 0, "the agent's log handler followed the fork"
        assert w["path"][0] == str(tmp_path / "scripts"), w["path"]
        assert w["path"][1] != str(tmp_path), "the agent's sys.path[0] (its cwd, for -m) followed"
        assert w["torch"], "preloaded"
        assert w["stdin"] == "/dev/null"
        assert w["server_sid"] == w["server"], "the server has its own session"
        files = [f for f in w["server_fds"] if not f.startswith(("socket:", "pipe:", "anon_inode:"))]
        assert files == ["/dev/null"], f"the server holds the agent's files: {files}"
        sockets = [f for f in w["server_fds"] if f.startswith("socket:")]
        assert len(sockets) == 1, f"its end of the control socket only, not the owner's: {sockets}"


def test_with_a_start_method_given_there_is_no_server(tmp_path: Path) -> None:
    done, seen = _run(tmp_path, "--start-method", "spawn")
    assert "preload server" not in done.stderr
    assert all(w["server"] != w["server_sid"] or not w["torch"] for w in seen)


def test_a_process_running_threads_starts_a_fresh_interpreter() -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="busy")
    t.start()
    try:
        assert can_fork() == "2 Python threads run here"
        server = PreloadServer(preload=("json",))
        try:
            server.start(fork=True)
            assert server.how == "a fresh interpreter (2 Python threads run here)"
            assert server.wait_ready(60)["ready"]
        finally:
            server.close()
    finally:
        stop.set()
        t.join()
    assert can_fork() is None


def test_without_fork_asked_it_is_a_fresh_interpreter() -> None:
    with PreloadServer(preload=("json",)) as server:
        assert server.how == "a fresh interpreter (not asked to)"


OWNER = """\
import os, signal, sys
from elastictk.supervisor.forkserver import PreloadServer
s = PreloadServer(preload=("json",))
s.start(fork=True)
s.wait_ready(60)
print(s.how, s.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_forked_server_dies_with_its_owner_killed() -> None:
    """The owner's end of the control socket is closed in the child: the kill is seen (EOF and
    the death signal), not an immortal server holding both ends."""
    done = subprocess.run([sys.executable, "-c", OWNER], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    how, pid = done.stdout.split()
    assert how == "forked"
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z":
        if time.monotonic() > deadline:
            os.kill(int(pid), signal.SIGKILL)
            pytest.fail("the forked server outlived its owner")
        time.sleep(0.05)


SLOW_OWNER = """\
import os, signal, sys, time
from elastictk.supervisor.forkserver import PreloadServer
s = PreloadServer(preload=("slowmod",))
s.start(fork=True)
assert s.how == "forked", s.how
while not os.path.exists("importing"):  # the server is inside its preload now
    time.sleep(0.01)
open("server.pid", "w").write(str(s.pid))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_forked_server_still_preloading_dies_with_its_owner(tmp_path: Path) -> None:
    """The owner is SIGKILLed while the server imports a module that takes 300 s: the death
    signal ends it at once (the control socket's EOF is read only after the preload, so
    without the death signal it would outlive its owner by the whole preload)."""
    (tmp_path / "slowmod.py").write_text("import time\nopen('importing', 'w').close()\ntime.sleep(300)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(tmp_path / "owner.err", "w") as err:  # a file: the server must not hold our pipe
        done = subprocess.run([sys.executable, "-c", SLOW_OWNER], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                              stdout=err, stderr=err, timeout=120)
    assert done.returncode == -signal.SIGKILL, (tmp_path / "owner.err").read_text()[-2000:]
    pid = int((tmp_path / "server.pid").read_text())
    deadline = time.monotonic() + 30  # far past a loaded machine's; without it the server lives 300 s
    while _running(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the forked server outlived its owner while preloading")
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Neither gone nor a zombie (its reaper may take the /proc entry away while we read it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(") ")[2][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False

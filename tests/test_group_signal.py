"""A worker's whole process group gets the stop (and forwarded) signal itself, not only the worker.

The per-process SIGKILL sweep after the grace period makes every tree die either way, so "nothing
survives" cannot tell a group signal from a signal to the worker alone. What can: a worker's
child that cleans up on SIGTERM/SIGINT (writes a marker) gets the signal, so the marker exists,
and ``stop(grace)`` returns as soon as that child is done instead of at the end of the grace.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from elastictk.supervisor.env import Assignment
from elastictk.supervisor.forkserver import PreloadServer
from elastictk.supervisor.group import WorkerGroup
from elastictk.supervisor.spec import WorkerSpec, python_script_argv

ROOT = Path(__file__).resolve().parent.parent

# The worker starts a child in its own process group (as torch's DataLoader workers or a
# compiler subprocess are) that writes "<signal name>" to child.<rank>.got on SIGTERM or SIGINT
# and exits; the worker itself dies of the default action. Ready once the child's handler is in.
CHILD_CLEANS_UP = """\
import os, subprocess, sys, time
d = sys.argv[1]
lr = os.environ.get("LOCAL_RANK", "0")
code = ("import os, signal, sys, time\\n"
        "def done(signum, frame):\\n"
        "    with open(sys.argv[1] + '.tmp', 'w') as f:\\n"
        "        f.write(signal.Signals(signum).name)\\n"
        "    os.rename(sys.argv[1] + '.tmp', sys.argv[1])\\n"
        "    os._exit(0)\\n"
        "signal.signal(signal.SIGTERM, done)\\n"
        "signal.signal(signal.SIGINT, done)\\n"
        "open(sys.argv[2], 'w').close()\\n"
        "time.sleep(600)\\n")
got, ready = os.path.join(d, f"child.{lr}.got"), os.path.join(d, f"child.{lr}.ready")
child = subprocess.Popen([sys.executable, "-c", code, got, ready])
while not os.path.exists(ready):
    time.sleep(0.01)
with open(os.path.join(d, f"worker.{lr}.tmp"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.rename(os.path.join(d, f"worker.{lr}.tmp"), os.path.join(d, f"worker.{lr}"))
time.sleep(600)
"""

GRACE = 10.0


def _wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"{path.name} never appeared")
        time.sleep(0.02)


def _spec(tmp_path: Path, ranks: int, method: str = "subprocess") -> WorkerSpec:
    script = tmp_path / "worker.py"
    script.write_text(CHILD_CLEANS_UP)
    return WorkerSpec(python_script_argv(str(script), str(tmp_path)), local_world_size=ranks,
                      start_method=method)


def _assign(ranks: int) -> Assignment:
    return Assignment.homogeneous(0, 1, ranks, master_addr="127.0.0.1", master_port=29500,
                                  run_id="pgrp")


def _children(tmp_path: Path, ranks: int) -> list[int]:
    out = []
    for lr in range(ranks):
        _wait_for(tmp_path / f"worker.{lr}")
        worker, child = (int(x) for x in (tmp_path / f"worker.{lr}").read_text().split())
        assert os.getpgid(child) == worker, "the child must share the worker's process group"
        out.append(child)
    return out


@pytest.mark.parametrize("method", ["subprocess", "preload"])
def test_stop_signals_the_workers_process_group_so_a_child_cleans_up_at_once(
        tmp_path: Path, method: str) -> None:
    with PreloadServer(preload=[]) as server, \
            WorkerGroup(_spec(tmp_path, 2, method), tmp_path / "logs", preload_server=server) as g:
        g.start(0, _assign(2))
        children = _children(tmp_path, 2)
        t0 = time.monotonic()
        results = g.stop(grace=GRACE)
        took = time.monotonic() - t0
        assert not [c for c in children if psutil.pid_exists(c)]
    got = {lr: (tmp_path / f"child.{lr}.got") for lr in range(2)}
    assert [p.exists() for p in got.values()] == [True, True], \
        "a worker's child never got SIGTERM: only the worker was signalled, not its group"
    assert {p.read_text() for p in got.values()} == {"SIGTERM"}
    assert {r.signal_name for r in results.values()} == {"SIGTERM"}
    assert took < GRACE / 2, f"stop took {took:.2f}s of a {GRACE:g}s grace: the child waited for SIGKILL"


def test_a_forwarded_signal_reaches_the_workers_children(tmp_path: Path) -> None:
    with WorkerGroup(_spec(tmp_path, 1), tmp_path / "logs") as g:
        g.start(0, _assign(1))
        _children(tmp_path, 1)
        g.signal_all(signal.SIGINT)
        _wait_for(tmp_path / "child.0.got", timeout=GRACE)
        assert (tmp_path / "child.0.got").read_text() == "SIGINT"
        g.stop(grace=GRACE)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_elastictk_run_forwards_its_signal_to_the_workers_children(tmp_path: Path, sig: int) -> None:
    script = tmp_path / "worker.py"
    script.write_text(CHILD_CLEANS_UP)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTICTK_"))}
    p = subprocess.Popen([sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node",
                          "1", "--shutdown-timeout", str(GRACE), str(script), str(tmp_path)],
                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    try:
        _children(tmp_path, 1)
        sent = time.monotonic()
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 128 + sig, err[-2000:]
    got = tmp_path / "child.0.got"
    assert got.exists(), f"the worker's child never got {signal.Signals(sig).name}"
    assert got.read_text() == signal.Signals(sig).name
    assert took < GRACE / 2, f"the launcher took {took:.2f}s of a {GRACE:g}s shutdown timeout"

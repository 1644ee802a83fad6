"""Launcher processes a benchmark starts, reads and reaps: what every launch from outside shares.

The recovery benchmark runs one launcher (``_recovery_job.Job``), the propagation benchmark
three at once (``_propagation_job.Cluster``); both treat the launchers as black boxes, the way
an operator sees them, and both need the same four things, kept here so each job module says
only what its lines mean:

- start a launcher in a session of its own (a Ctrl-C at the benchmark's terminal reaches the
  benchmark, which then stops the launcher, and with it its workers, the orderly way);
- read its merged stdout/stderr on a thread that stamps every line with ``time.monotonic()``
  the moment it arrives, writes it to a log and notifies a condition per line and at the end;
- wait on that condition until a predicate over what was read holds, a timeout, or the end of
  output, each a :class:`BenchError` naming what did not come;
- reap: SIGTERM the launchers still running, SIGKILL after 30 s, then SIGKILL every process
  they started that is still alive (psutil checks the pid still names the process it saw).
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import psutil

from .common import BenchError


def launch(argv: Sequence[str], cwd: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """``argv`` in a session of its own, stdout and stderr merged into one pipe."""
    return subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def launcher_env(env: Optional[Mapping[str, str]]) -> dict[str, str]:
    """This process's environment, unbuffered, with ``env`` over it."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}


def read_stamped(proc: subprocess.Popen[bytes], log_path: Path, started_at: float, cond: threading.Condition,
                 on_line: Callable[[float, str], None], on_eof: Callable[[], None]) -> None:
    """Every line of ``proc``'s output to ``log_path`` (seconds since ``started_at`` first) and
    to ``on_line(t, line)`` under ``cond``, notified per line; ``on_eof`` at the end."""
    assert proc.stdout is not None
    with open(log_path, "wb") as log:
        for raw in iter(proc.stdout.readline, b""):
            t = time.monotonic()
            log.write(f"{t - started_at:9.3f} ".encode() + raw)
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with cond:
                on_line(t, line)
                cond.notify_all()
    with cond:
        on_eof()
        cond.notify_all()


def wait_until(cond: threading.Condition, pred: Callable[[], bool], ended: Callable[[], bool], timeout: float,
               what: str, tail: Callable[[], str], prefix: str = "") -> None:
    """Block until ``pred()`` holds (checked under ``cond``); BenchError naming ``what`` when the
    output ``ended()`` first or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    with cond:
        while not pred():
            if ended():
                raise BenchError(f"{prefix}output ended before {what}; {tail()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"{prefix}no {what} within {timeout:.0f}s; {tail()}")
            cond.wait(left)


def descendants(pid: int, seen: dict[int, psutil.Process]) -> list[psutil.Process]:
    """The live descendants of ``pid``, each remembered in ``seen`` for reaping."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    for p in kids:
        seen.setdefault(p.pid, p)
    return kids


def reap(procs: Sequence[subprocess.Popen[bytes]], readers: Sequence[Optional[threading.Thread]],
         seen: Mapping[int, psutil.Process]) -> list[int]:
    """Stop the launchers that still run (SIGTERM, then SIGKILL), SIGKILL any process in
    ``seen`` still alive, join the readers; every pid in ``seen``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(30)
    left = [p for p in seen.values() if alive(p)]
    for p in left:
        try:
            p.kill()  # psutil checks the pid still names the process it saw
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=30)
    for p, th in zip(procs, readers):
        if p.stdout is not None:
            if th is not None:
                th.join(30)
            p.stdout.close()
    return sorted(seen)


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False

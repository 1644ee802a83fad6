"""A watcher process that kills the workers' sessions if the agent dies without stopping them.

``PR_SET_PDEATHSIG`` kills a worker when its agent dies, but not the worker's own children: they
are reparented to init and keep running (holding GPUs, ports, files). Nothing inside the agent can
act after a SIGKILL, so a tiny separate process does it. It holds the read end of a pipe whose
only write end lives in the agent; the kernel closes that end however the agent dies, the
watcher reads EOF and SIGKILLs every process in the registered worker sessions (each worker is
a session leader, so its descendants carry its pid as session id). A clean ``close()`` says
``bye`` first, and the watcher exits without touching anything.

Runs as ``python -I -S deathwatch.py``: standard library only (and ``procfs.py`` beside it), so
it starts in tens of milliseconds and does not import elastictk, torch or whatever the agent imported.
Limit: a descendant that calls ``setsid`` itself leaves the worker's session and escapes it.
The agent unregisters a finished worker's session once nothing it pinned of it is left (its id
is free for anyone then), and each kill goes through a pidfd opened before the membership check.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from typing import IO, Optional

if __package__:
    from .procfs import live_members, read_stat
else:  # run as a script (python -I -S deathwatch.py): procfs.py lies beside it, stdlib only
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from procfs import live_members, read_stat  # type: ignore[import-not-found,no-redef]

_ROUNDS = 50
_ROUND_WAIT = 0.5


def _kill_sessions(ids: set[int]) -> None:
    me = os.getpid()
    for _ in range(_ROUNDS):  # repeat: a process may fork while its siblings are being killed
        pids = live_members(ids, exclude=me)
        if not pids:
            return
        fds = []
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            fds.append(fd)
            # Read after the pidfd pins the process: the member found, not a PID's next owner.
            st = read_stat(pid)
            if st is None or (st.session not in ids and st.pgrp not in ids):
                continue
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + _ROUND_WAIT
        pending = list(fds)
        while pending and time.monotonic() < deadline:
            ready, _, _ = select.select(pending, [], [], max(0.0, deadline - time.monotonic()))
            pending = [fd for fd in pending if fd not in ready]
        for fd in fds:
            os.close(fd)


def main() -> int:
    """Read ``+sid``/``-sid`` lines until ``bye`` (exit quietly) or EOF (kill, then exit)."""
    # It ends on bye or EOF only: a scheduler signals every process of a job (Slurm's
    # scancel --signal), and a watch killed by it would leave the workers' descendants unwatched.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    ids: set[int] = set()
    stdin = sys.stdin.buffer
    for raw in stdin:
        line = raw.strip()
        if line == b"bye":
            return 0
        if line[:1] == b"+":
            ids.add(int(line[1:]))
        elif line[:1] == b"-":
            ids.discard(int(line[1:]))
    if ids:
        _kill_sessions(ids)
    return 0


class DeathWatch:
    """Owner of one watcher process: ``watch(sid)`` when a worker starts, ``close()`` at the end."""

    def __init__(self) -> None:
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._stdin: Optional[IO[bytes]] = None
        self._warned = False

    def start(self) -> None:
        if self._proc is not None:
            return
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__)],
            stdin=subprocess.PIPE, close_fds=True, start_new_session=True,
        )
        self._stdin = self._proc.stdin

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc else None

    def fileno(self) -> Optional[int]:
        """The agent's end of the pipe (a fork-started worker must close it)."""
        return self._stdin.fileno() if self._stdin is not None else None

    def _send(self, line: str) -> None:
        if self._stdin is None:
            raise RuntimeError("DeathWatch is not started")
        try:
            self._stdin.write(line.encode() + b"\n")
            self._stdin.flush()
        except (BrokenPipeError, ValueError):
            # The watcher was killed from outside. Workers still die with the agent (their
            # death signal); only their orphaned descendants lose this safety net.
            if not self._warned:
                self._warned = True
                print("elastictk: the death watch process is gone; descendants of workers may "
                      "outlive a SIGKILLed agent", file=sys.stderr)

    def watch(self, session: int) -> None:
        self._send(f"+{session}")

    def unwatch(self, session: int) -> None:
        self._send(f"-{session}")

    def close(self, timeout: float = 5.0) -> None:
        """Tell the watcher all is well and reap it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if self._stdin is not None:
                self._stdin.write(b"bye\n")
                self._stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        self._stdin = None
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


if __name__ == "__main__":
    sys.exit(main())

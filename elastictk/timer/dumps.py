"""Taking one process's stack dump: open its dump file, signal it, wait until the dump is whole.

Apart from the reaper because it is its own protocol with the worker's signal handler (see
``client``: the handler appends every thread's stack to a memfd), used twice by the server: to
explain an expired timer before the kill, and for the progress watchdog's look at a running
worker that is not killed. It knows nothing of timers or regions: a process, an fd number in it,
and the signal its handler answers.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Optional

from . import layout as L
from ..lifetime.handle import ProcessHandle
from ..lifetime.procfs import signal_state

_POLL = 0.001  # how often the dump wait looks at the process


@dataclass
class Dump:
    """One process's dump in progress: our own fd of its dump file and how far it grew."""

    target: ProcessHandle
    stacks_fd: Optional[int] = None  # None: no dump to wait for (``note`` says why)
    blocked_before: Optional[frozenset[int]] = None  # threads that blocked the dump signal
    size0: int = 0
    last_size: int = 0
    last_change: float = 0.0
    note: str = ""
    done: bool = False


def open_stacks(target: ProcessHandle, stacks_fd: int) -> Dump:
    """Open the target's stack memfd ourselves (fd ``stacks_fd`` in it): it then outlives a
    SIGKILL. A fd that is gone or no longer the dump file gives a dump with only a note."""
    d = Dump(target)
    path = L.stacks_path(target.pid, stacks_fd)
    try:
        if not os.readlink(path).startswith(f"/memfd:{L.STACKS_MEMFD_NAME}"):
            d.note = f"fd {stacks_fd} of pid {target.pid} is no longer the stack dump file"
            return d
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        d.note = f"cannot open the stack dump of pid {target.pid}: {e.strerror}"
        return d
    d.stacks_fd = fd
    d.size0 = d.last_size = os.fstat(fd).st_size
    return d


def signal_dump(d: Dump, dump_signal: int, *, resume: bool = False) -> None:
    """Ask the target for its stacks, noting first which threads block the signal; with
    ``resume``, a stopped target is continued too (a stopped process runs no handler)."""
    state = signal_state(d.target.pid, dump_signal)
    d.blocked_before = None if state is None else state[1]
    d.target.send(dump_signal)
    if resume and d.target.state() in ("T", "t"):
        d.target.send(signal.SIGCONT)


def await_dumps(dumps: list[Dump], dump_signal: int, timeout: float, quiet: float) -> None:
    """Until every dump is complete, the process died, or ``timeout`` passed.

    Complete means the handler returned (see ``proc.signal_state``); where ``/proc`` cannot
    tell, or a thread that blocks the signal appeared meanwhile, a dump that grew and then
    stayed unchanged for ``quiet`` counts as complete.
    """
    start = time.monotonic()
    for d in dumps:
        d.last_change = start
        d.done = d.stacks_fd is None
    while not all(d.done for d in dumps):
        if time.monotonic() - start >= timeout:
            for d in dumps:
                if not d.done and d.last_size == d.size0:
                    d.note = f"no stack dump within {timeout:g} s"
            break
        time.sleep(_POLL)
        now = time.monotonic()
        for d in dumps:
            if not d.done:
                _check(d, now, dump_signal, quiet)


def read_dump(d: Dump) -> str:
    """What the target appended since the dump was opened (empty without one); closes our fd."""
    if d.stacks_fd is None:
        return ""
    try:
        size = os.fstat(d.stacks_fd).st_size
        return os.pread(d.stacks_fd, max(0, size - d.size0), d.size0).decode("utf-8", "replace")
    finally:
        os.close(d.stacks_fd)
        d.stacks_fd = None


def _check(d: Dump, now: float, dump_signal: int, quiet: float) -> None:
    assert d.stacks_fd is not None
    size = os.fstat(d.stacks_fd).st_size
    if size != d.last_size:
        d.last_size, d.last_change = size, now
    if d.target.exited():
        d.done = True
        if size == d.size0:
            d.note = "the process exited before it dumped its stacks"
        return
    if d.blocked_before is not None:
        state = signal_state(d.target.pid, dump_signal)
        if state is not None and not state[0] and not (state[1] - d.blocked_before):
            d.done = True
            return
    if size > d.size0 and now - d.last_change >= quiet:
        d.done = True

"""Waiting for descriptors to become readable, with poll(2) rather than select(2).

select(2) cannot watch a descriptor numbered 1024 or more (Python raises "filedescriptor out
of range in select()"). A long-lived agent gets there: every restart opens pidfds, pipes and
store sockets, and a job that runs for weeks must not die of its own descriptor count. poll(2)
has no such limit and is as cheap for the handful of descriptors waited on at once here.
"""
from __future__ import annotations

import select
from typing import Optional, Protocol, Sequence, TypeVar


class _HasFileno(Protocol):
    def fileno(self) -> int: ...


W = TypeVar("W", bound=int | _HasFileno)

#: what select(2) reports as readable: data, end of file, a hang-up, an error
_READY = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR | select.POLLNVAL


def readable(waitables: Sequence[W], timeout: Optional[float]) -> list[W]:
    """The members of ``waitables`` (descriptors or objects with ``fileno()``) that are
    readable, waiting at most ``timeout`` seconds (None: until one is; 0: just look).
    Like ``select.select(waitables, [], [], timeout)[0]``, without its 1024 limit; a closed
    descriptor counts as ready (its read then fails), where select would raise."""
    if not waitables:
        return []
    poller = select.poll()
    by_fd: dict[int, list[W]] = {}
    for w in waitables:
        fd = w if isinstance(w, int) else w.fileno()
        by_fd.setdefault(fd, []).append(w)
        poller.register(fd, select.POLLIN | select.POLLPRI)
    ms = None if timeout is None else max(0, int(timeout * 1000 + 0.999))
    out: list[W] = []
    for fd, events in poller.poll(ms):
        if events & _READY:
            out += by_fd.get(fd, [])
    return out

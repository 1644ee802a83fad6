"""A one-way flag that a signal handler may raise: a bool and a byte down a pipe.

``threading.Event`` is not safe there. Its ``set()`` takes the Event's lock, and a Python signal
handler runs on the main thread between two bytecodes of whatever that thread was doing: inside
``Event.wait``'s bookkeeping (the lock held) or inside the ``set()`` of a first handler, when a
second SIGTERM follows the first. The handler then waits on a lock its own thread holds, and the
process hangs for good (an ``elastictk-chaos`` run was seen hung this way, 11 minutes past its
``timeout``). Raising this flag takes no lock; a waiter sleeps in poll(2) on the pipe.
"""
from __future__ import annotations

import os
import time
import weakref
from typing import Optional

from .ready import readable


def _close(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class SignalFlag:
    """``set``, ``is_set``, ``wait`` and ``clear`` as ``threading.Event`` has them; ``set`` is
    safe from a signal handler (and any thread). The pipe closes with the flag."""

    def __init__(self) -> None:
        self._flag = False
        self._r, self._w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._finalizer = weakref.finalize(self, _close, self._r, self._w)

    def set(self) -> None:
        self._flag = True
        fd = self._w
        if fd < 0:
            return  # closed: never write into a descriptor number reused since
        try:
            os.write(fd, b"\0")
        except OSError:  # the pipe is full (a wake-up is pending already) or closed
            pass

    def is_set(self) -> bool:
        return self._flag

    def clear(self) -> None:
        self._flag = False
        self._drain()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Until the flag is raised or ``timeout`` passes; returns whether it is raised."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while not self._flag:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            if self._r < 0:
                break  # closed: nothing will wake us through it
            if readable([self._r], left):  # poll(2): an agent's descriptors pass 1024
                self._drain()
        return self._flag

    def close(self) -> None:
        self._r = self._w = -1
        self._finalizer()

    def _drain(self) -> None:
        if self._r < 0:
            return
        try:
            while os.read(self._r, 4096):
                pass
        except OSError:
            pass

"""``ExitWatch``: one ``select`` over every worker's exit fd, result pipe and a wakeup pipe.

Apart from ``group.py`` because it is the group's one blocking wait and its only event source:
how an exit, a result or a ``wake()`` is seen as it happens, without a polling sleep. What an
exit *means* (reaping, the worker's session, its ``WorkerResult``) stays with the group, which
hands it in as ``on_exit``.

``wake`` may be called from any thread or a signal handler (a pipe write); everything else
belongs to the thread that owns the group.
"""
from __future__ import annotations

import os
import selectors
import time
from typing import Callable, Optional

from .process import WorkerProcess
from .sessions import SWEEP_EVERY
from .spec import WorkerResult


class ExitWatch:
    """The workers' exit fds (pidfds) and result pipes, plus a wakeup pipe, in one selector."""

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self._pending_wake = False

    def add(self, w: WorkerProcess) -> None:
        """Watch a started worker's exit (pidfd) and result pipe."""
        self._sel.register(w.exit_fd(), selectors.EVENT_READ, ("exit", w))
        fd = w.result_fd()
        if fd is not None:
            self._sel.register(fd, selectors.EVENT_READ, ("result", w))

    def drop(self, w: WorkerProcess) -> None:
        """Stop watching ``w`` (finished, or given up on); its fds may already be gone."""
        for fd in (w.exit_fd(), w.result_fd()):
            if fd is not None and fd >= 0 and fd in self._sel.get_map():
                self._sel.unregister(fd)

    def fds(self) -> list[int]:
        """The watch's own fds, which a fork-started worker closes first."""
        return [self._wake_r, self._wake_w, self._sel.fileno()]

    def wake(self) -> None:
        """Make a blocked ``wait`` return now. Safe from any thread or signal handler."""
        fd = self._wake_w
        if fd < 0:
            return  # closed: a late watch thread must not write into a reused fd number
        try:
            os.write(fd, b"\0")
        except (BlockingIOError, OSError):
            pass

    def take_pending_wake(self) -> bool:
        """True once for a ``wake()`` that arrived while a wait ignored wake-ups."""
        pending, self._pending_wake = self._pending_wake, False
        return pending

    def wait(self, deadline: Optional[float], *, running: Callable[[], bool],
             sweep: Callable[[], None], on_exit: Callable[[WorkerProcess], Optional[WorkerResult]],
             stop_on_first: bool, ignore_wake: bool = False) -> list[WorkerResult]:
        """Select while ``running()``, until ``deadline`` (monotonic), the first exit
        (``stop_on_first``) or a wake-up (unless ``ignore_wake``: then it is kept pending).

        ``sweep`` runs at least every ``SWEEP_EVERY`` seconds; ``on_exit`` is called for a
        worker whose exit fd is readable and returns its result once it is reaped (None while
        it is not), after which its fds are no longer watched. Returns the results seen.
        """
        new: list[WorkerResult] = []
        done: set[int] = set()  # workers finished earlier in this batch (by id)
        while running():
            sweep()
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            remaining = SWEEP_EVERY if remaining is None else min(remaining, SWEEP_EVERY)
            woke = False
            for key, _ in self._sel.select(remaining):
                kind, w = key.data
                if kind == "wake":
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    woke = not ignore_wake
                    self._pending_wake = self._pending_wake or ignore_wake
                elif id(w) in done:
                    continue  # finished earlier in this batch; its fds are unregistered
                elif kind == "result":
                    if w.take_result():
                        self._sel.unregister(key.fd)
                else:
                    result = on_exit(w)
                    if result is not None:
                        done.add(id(w))
                        new.append(result)
            if new and stop_on_first or woke:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
        return new

    def close(self) -> None:
        self._sel.close()
        wake_r, wake_w, self._wake_r, self._wake_w = self._wake_r, self._wake_w, -1, -1
        os.close(wake_r)
        os.close(wake_w)

"""A process pinned by pidfd and start time: signals reach the process registered, or none.

A PID names a process only until it is reaped; after that the kernel may hand it to anyone. A
reaper that kills "pid 1234" some time after reading it can therefore kill a stranger (torch's
timer servers do ``os.kill(pid)``, and its FileTimerServer even signals its own agent). Here a
worker is a :class:`ProcessHandle`: a pidfd (signals sent through it can only reach the process
it was opened for) plus the process start time read from ``/proc`` when it was registered. A
handle whose PID now has another start time, or whose process has exited, refuses to signal.
"""
from __future__ import annotations

import os
import select
import signal
from typing import Optional

from .procfs import ProcUnreadable, read_stat, start_time, stat


class ProcessHandle:
    """One process, pinned: a pidfd and the start time it had when registered.

    ``expected_start_time`` is what the caller believes the process's start time is (e.g. read
    when it was spawned); by default it is read now. Refuses PID 0/1 and the calling process.
    """

    def __init__(self, pid: int, expected_start_time: Optional[int] = None) -> None:
        if pid <= 1:
            raise ValueError(f"pid {pid} cannot be a worker")
        if pid == os.getpid():
            raise ValueError(f"pid {pid} is this process (the agent); it is never signalled")
        self.pid = pid
        self._fd: Optional[int] = None
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            pass  # already gone: the handle is dead from the start
        except (AttributeError, OSError):
            self._fd = -1  # no pidfd on this kernel: start time checks only
        now = start_time(pid)
        self.start_time = now if expected_start_time is None else expected_start_time
        # The pidfd is proven to be the registered process once its start time matched while
        # the pidfd showed it running (checked after the read): from then on "alive" needs no
        # /proc read, so a /proc this process cannot read (out of fds) never looks like a death.
        self._verified = False
        if now is not None:
            self._verify(now)

    def _verify(self, now: int) -> bool:
        if now == self.start_time and self._fd is not None and self._fd >= 0 and not self.exited():
            self._verified = True
        return self._verified

    def same_process(self) -> bool:
        """Still the registered process: alive, and its PID has the registered start time.
        False also when that cannot be told now (``/proc`` unreadable before the pidfd was
        verified): the answer gates signals."""
        if self.exited():
            return False
        if self._verified:
            return True
        try:
            st = stat(self.pid)
        except ProcUnreadable:
            return False
        if st is None or st.start_time != self.start_time:
            return False
        return self._verify(st.start_time) or self._fd == -1

    def exited(self) -> bool:
        """The process is gone (or a zombie): its pidfd is readable."""
        if self._fd is None:
            return True
        if self._fd < 0:
            try:
                st = stat(self.pid)
            except ProcUnreadable:
                return False  # not known to have exited: an fd error is not a death
            return st is None or st.state == "Z"
        p = select.poll()
        p.register(self._fd, select.POLLIN)
        return bool(p.poll(0))

    def held(self) -> bool:
        """Its PID still names it: alive, or a zombie not yet reaped (a zombie keeps its PID,
        process group and session ids allocated, so none of them can have been reused).

        :class:`~.procfs.ProcUnreadable` when only ``/proc`` could tell (the process has exited,
        or the pidfd is unverified) and it cannot be read now."""
        if self._fd is None:
            return False
        if self._verified and not self.exited():
            return True
        st = stat(self.pid)
        return st is not None and st.start_time == self.start_time

    @classmethod
    def pin(cls, pid: int, expected_start_time: int) -> "Optional[ProcessHandle]":
        """A handle on the process that had ``expected_start_time`` at ``pid`` (read from a
        ``/proc`` snapshot), or None if that process is gone or exiting. The pidfd is opened
        first and the start time checked after, while the pidfd shows the process running: the
        PID cannot have changed hands in between, so the handle pins the process read."""
        if pid <= 1 or pid == os.getpid():
            return None
        h = cls(pid, expected_start_time)
        if h._fd is None or h._fd < 0 or not h.same_process():
            h.close()
            return None
        return h

    def fileno(self) -> Optional[int]:
        """The pidfd (readable once the process has exited), or None."""
        return self._fd if self._fd is not None and self._fd >= 0 else None

    def state(self) -> Optional[str]:
        st = read_stat(self.pid) if self.same_process() else None
        return None if st is None else st.state

    def send(self, sig: int) -> bool:
        """Send ``sig`` if this is still the registered process; whether it was sent."""
        if not self.same_process():
            return False
        try:
            if self._fd is not None and self._fd >= 0:
                signal.pidfd_send_signal(self._fd, sig)
            else:
                os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def close(self) -> None:
        if self._fd is not None and self._fd >= 0:
            os.close(self._fd)
        self._fd = None

    def __repr__(self) -> str:
        return f"<ProcessHandle pid={self.pid} start_time={self.start_time}>"

"""Signalling a worker safely: the process that was registered, never a reused PID, never us.

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
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` the reaper needs."""

    state: str  # R, S, D, T (stopped), t (traced), Z (zombie) ...
    ppid: int
    session: int
    start_time: int  # clock ticks after boot: with the PID, unique for the machine's uptime


def read_stat(pid: int) -> Optional[ProcStat]:
    """``/proc/<pid>/stat`` parsed, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(b")") + 2:].split()
    return ProcStat(state=fields[0].decode(), ppid=int(fields[1]), session=int(fields[3]),
                    start_time=int(fields[19]))


def _mask(status: str, field: str) -> int:
    for line in status.splitlines():
        if line.startswith(field):
            return int(line.split()[1], 16)
    return 0


def signal_state(pid: int, sig: int) -> Optional[tuple[bool, frozenset[int]]]:
    """Whether ``sig`` is pending for ``pid``, and which of its threads have it blocked; None
    if ``/proc`` cannot tell.

    A handler installed without ``SA_NODEFER`` (faulthandler's, when it does not chain) runs
    with its signal blocked, and the kernel dequeues the signal and blocks it in one step. So
    "not pending, and blocked in no thread that did not block it before" means the handler has
    run to completion: the dump is complete, no guessing from file sizes needed.
    """
    bit = 1 << (sig - 1)
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            pending = bool(_mask(f.read(), "ShdPnd:") & bit)
        blocked = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/status", encoding="ascii") as f:
                    status = f.read()
            except (FileNotFoundError, ProcessLookupError):
                continue  # the thread ended
            pending = pending or bool(_mask(status, "SigPnd:") & bit)
            if _mask(status, "SigBlk:") & bit:
                blocked.add(int(tid))
        return pending, frozenset(blocked)
    except (OSError, ValueError, IndexError):
        return None


def start_time(pid: int) -> Optional[int]:
    st = read_stat(pid)
    return None if st is None else st.start_time


def in_tree(pid: int, root: int, max_depth: int = 64) -> bool:
    """Whether ``pid`` is ``root`` or runs under it: a descendant by parent links, or a member of
    the session ``root`` leads (workers lead their own session, and an orphaned grandchild keeps
    the session after it is re-parented)."""
    st = read_stat(pid)
    if st is None:
        return False
    if pid == root or st.session == root:
        return True
    for _ in range(max_depth):
        if st.ppid <= 1:
            return False
        if st.ppid == root:
            return True
        nxt = read_stat(st.ppid)
        if nxt is None:
            return False
        st = nxt
    return False


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

    def same_process(self) -> bool:
        """Still the registered process: alive, and its PID has the registered start time."""
        if self.exited():
            return False
        now = start_time(self.pid)
        return now is not None and now == self.start_time

    def exited(self) -> bool:
        """The process is gone (or a zombie): its pidfd is readable."""
        if self._fd is None:
            return True
        if self._fd < 0:
            st = read_stat(self.pid)
            return st is None or st.state == "Z"
        p = select.poll()
        p.register(self._fd, select.POLLIN)
        return bool(p.poll(0))

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

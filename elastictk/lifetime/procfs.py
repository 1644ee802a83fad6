"""Reading ``/proc``: the one parser of a process's stat and signal state in elastictk.

A PID names a process only until it is reaped, so everything that decides whether to signal a
process (the supervisor's stop, the timer reaper, the death watch, in-place recovery's frozen
check) reads the same few fields: state, parent, process group, session and start time. The
command name in ``/proc/<pid>/stat`` may hold spaces and ')' — parsing it in one place keeps
every caller from getting that wrong.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` the reaper needs."""

    state: str  # R, S, D, T (stopped), t (traced), Z (zombie) ...
    ppid: int
    pgrp: int
    session: int
    start_time: int  # clock ticks after boot: with the PID, unique for the machine's uptime


def parse_stat(raw: bytes) -> ProcStat:
    """One ``/proc/<pid>/stat`` line. The command name (field 2) may contain spaces and
    parentheses, so the fields are split after the last ')'."""
    fields = raw[raw.rindex(b")") + 2:].split()
    return ProcStat(state=fields[0].decode(), ppid=int(fields[1]), pgrp=int(fields[2]),
                    session=int(fields[3]), start_time=int(fields[19]))


GONE = (errno.ENOENT, errno.ESRCH)
"""The only errors reading ``/proc/<pid>`` that mean the process is gone."""


class ProcUnreadable(OSError):
    """``/proc`` could not be read for a reason that says nothing about the process (out of
    file descriptors, EACCES, ENOMEM...): it may well be alive, so nothing may be decided as if
    it were gone."""


def stat(pid: int) -> Optional[ProcStat]:
    """``/proc/<pid>/stat`` parsed; None only if the process is gone (ENOENT/ESRCH, or a line
    cut short by its exit); :class:`ProcUnreadable` if ``/proc`` cannot tell now. For every
    decision that treats a process as gone (forget it, stop tracking it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError as e:
        if e.errno in GONE:
            return None
        raise ProcUnreadable(e.errno, f"/proc/{pid}/stat cannot be read now: {e.strerror}") from None
    try:
        return parse_stat(raw)
    except (ValueError, IndexError):
        return None


def read_stat(pid: int) -> Optional[ProcStat]:
    """``/proc/<pid>/stat`` parsed, or None if there is no such process or it cannot be read.

    Best effort, for callers where "cannot tell" and "gone" lead to the same safe action (not
    signalling, not listing); a decision that a process is gone uses :func:`stat`. Safe in a
    ``preexec_fn``: one open, one read, no allocation beyond the line's fields.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    try:
        return parse_stat(raw)
    except (ValueError, IndexError):
        return None


def cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU seconds ``pid`` has used (``/proc/<pid>/stat`` utime + stime), or None
    if it cannot be read: the hang judge tells a rank that computes from one that waits."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def is_frozen(pid: int) -> bool:
    """Stopped by a signal (``T``) or by a tracer (``t``): alive, but it will never answer."""
    st = read_stat(pid)
    return st is not None and st.state in ("T", "t")


def pids() -> list[int]:
    """Every PID on this machine now (a snapshot; any of them may exit at once);
    :class:`ProcUnreadable` when ``/proc`` cannot be listed now (out of file descriptors: the
    caller decides what to do without the list, never as if no process were running)."""
    try:
        names = os.listdir("/proc")
    except OSError as e:
        raise ProcUnreadable(e.errno, f"/proc cannot be listed now: {e.strerror}") from None
    return [int(name) for name in names if name.isdigit()]


def live_members(ids: set[int], exclude: int) -> list[int]:
    """Live (non-zombie) PIDs whose session or process group is in ``ids``, but ``exclude``."""
    out = []
    for pid in pids():
        if pid == exclude:
            continue
        st = read_stat(pid)
        if st is None or st.state in ("Z", "X"):
            continue
        if st.session in ids or st.pgrp in ids:
            out.append(pid)
    return out


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


def snapshot() -> dict[int, ProcStat]:
    """Every live or zombie process now, by PID, in one pass over ``/proc`` (each entry read
    atomically; the set as a whole is a snapshot only approximately)."""
    out = {}
    for pid in pids():
        st = read_stat(pid)
        if st is not None:
            out[pid] = st
    return out


def descendants(root: int) -> set[int]:
    """Every process below ``root`` now (children, theirs, ...), from one :func:`snapshot`."""
    children: dict[int, list[int]] = {}
    for pid, st in snapshot().items():
        children.setdefault(st.ppid, []).append(pid)
    out: set[int] = set()
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, ()))
    return out


def cmdline(pid: int) -> Optional[str]:
    """``/proc/<pid>/cmdline`` as one line (arguments joined by spaces), or None if gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")


def own_children() -> list[int]:
    """This process's children (every thread's): ``/proc/self/task/*/children`` where the
    kernel has it, else a scan of ``/proc`` for this PID as parent."""
    me = os.getpid()
    try:
        tids = os.listdir(f"/proc/{me}/task")
    except OSError:
        tids = []
    out: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{me}/task/{tid}/children", "rb") as f:
                out.extend(int(p) for p in f.read().split())
        except FileNotFoundError:  # CONFIG_PROC_CHILDREN is off: scan instead
            try:
                return [pid for pid, st in snapshot().items() if st.ppid == me]
            except ProcUnreadable:
                return out  # none found now: the next sweep looks again
        except (OSError, ValueError):
            continue
    return out

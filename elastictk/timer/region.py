"""Claiming one rank's region of the agent's timer file, for this process's timers.

Apart from ``client.py`` (the timers themselves, whose hot path reads module globals) because
it is the one place a worker's timers can fail to start, and every way they fail is said
here: the file gone (the agent ended), the local rank outside the file, the region claimed by
another process (a child that inherited the environment), a header from another version, a
dump signal that cannot be registered. The claim is a byte-range ``lockf`` held until the
process dies and not inherited by its children; stack dumps go to a memfd the agent reads
(``dumps.py``); the agent's wake pipe is opened write-only when the region names one.
"""
from __future__ import annotations

import faulthandler
import fcntl
import mmap
import os
from dataclasses import dataclass
from typing import Optional

from . import layout as L


class TimerError(RuntimeError):
    """Timers used wrongly (entered twice, released unheld, too many held) or a region that
    cannot be attached; the message says what to do."""


@dataclass(frozen=True)
class Claimed:
    """A region this process now owns: its file's fd (closing it drops the claim), the
    mapping, the stack-dump memfd registered with faulthandler, the wake pipe (or -1)."""

    fd: int
    mm: mmap.mmap
    stacks_fd: int
    wake_fd: int


def claim(path: str, local_rank: int) -> Claimed:
    """Claim region ``local_rank`` of ``path``; :class:`TimerError` naming the problem (with
    everything opened so far closed again) otherwise."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise TimerError(f"cannot open timer regions {path}: {e.strerror} (the agent that "
                         "started this worker created them; is it still running?)") from None
    offset = local_rank * L.REGION_SIZE
    mm: Optional[mmap.mmap] = None
    sfd = -1
    try:
        size = os.fstat(fd).st_size
        if local_rank < 0 or offset + L.REGION_SIZE > size:
            raise TimerError(f"{path} has regions for local ranks 0..{size // L.REGION_SIZE - 1}, "
                             f"not {local_rank}; LOCAL_RANK does not match the agent's group")
        try:  # the claim: held until this process dies, not inherited by its children
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, L.REGION_SIZE, offset)
        except OSError:
            raise TimerError(f"timer region {local_rank} is already used by another process (a "
                             "process this worker started inherited its environment)") from None
        mm = mmap.mmap(fd, L.REGION_SIZE, offset=offset)
        problem = L.check_header(memoryview(mm))
        if problem is not None:
            raise TimerError(f"cannot use region {local_rank} of {path}: {problem}")
        dump_signal = L.U32.unpack_from(mm, L.OFF_SIGNAL)[0]
        sfd = os.memfd_create(L.STACKS_MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            faulthandler.register(dump_signal, file=sfd, all_threads=True, chain=False)
        except (RuntimeError, ValueError, OSError) as e:
            raise TimerError(
                f"cannot register the stack dump for signal {dump_signal}: {e}") from None
    except BaseException:
        if sfd >= 0:
            os.close(sfd)
        if mm is not None:
            mm.close()
        os.close(fd)  # also drops the claim
        raise
    return Claimed(fd, mm, sfd, open_wake(path, L.U32.unpack_from(mm, L.OFF_WAKE_FD)[0]))


def open_wake(regions_path: str, wake_fd: int) -> int:
    """The agent's wake pipe, or -1 (then the agent still looks every idle interval)."""
    path = L.wake_path(regions_path, wake_fd)
    if path is None:
        return -1
    try:
        return os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return -1

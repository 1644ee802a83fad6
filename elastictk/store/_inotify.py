"""A minimal inotify watch on one directory, through ctypes (no new dependency).

The file store only needs to know *that* something may have changed in its directory, so a
waiter can re-check its keys at once instead of sleeping: events are drained, never parsed.
Where inotify is missing (not Linux, no libc symbol, out of watches) :func:`open_watch` returns
``None`` and callers poll; on NFS inotify sees only this host's writes, so callers poll too.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import select

IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC


def _load_libc() -> "ctypes.CDLL | None":
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_init1.restype = ctypes.c_int
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        libc.inotify_add_watch.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


class DirWatch:
    """An inotify fd watching one directory for the given event mask.

    Use: :meth:`drain` (forget what happened so far), check the condition, then
    :meth:`wait` for the next change. Draining before the check means no change that lands
    between the check and the wait is ever missed.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def drain(self) -> None:
        while True:
            try:
                if not os.read(self.fd, 65536):
                    return
            except BlockingIOError:
                return
            except InterruptedError:
                continue

    def wait(self, timeout: float) -> bool:
        """Whether an event arrived within ``timeout`` seconds (it is left queued)."""
        return bool(self._poll.poll(max(0, int(timeout * 1000 + 0.999))))

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def open_watch(path: str, mask: int) -> DirWatch | None:
    """A watch on directory ``path``, or ``None`` where inotify is unavailable."""
    if _LIBC is None:
        return None
    fd = _LIBC.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
    if fd < 0:
        return None  # EMFILE (out of inotify instances) and friends: callers fall back to polling
    if _LIBC.inotify_add_watch(fd, os.fsencode(path), mask) < 0:
        os.close(fd)  # ENOSPC (out of watches), EACCES, ...: callers fall back to polling
        return None
    return DirWatch(fd)

"""The file store's file operations, safe against killed writers and planted files.

Apart from ``file.py`` because it is the part that touches the filesystem under the store's
guarantees; ``file.py`` composes these into the ``Store`` primitives.

- Every write goes to a private temp file, is fsynced (``durable``), then ``os.replace``\\ d over
  the key file: readers see the old value or the new one, never part of one, and need no lock.
  A writer killed before the rename leaves only a temp file, removed once it is older than
  :data:`TEMP_MAX_AGE`.
- A stripe lock is an ``flock`` the kernel drops when its holder dies; taking it polls with a
  short backoff, so a stopped holder or a hung filesystem is an error, not a hang.
- A key or lock file that is not a regular file (a FIFO, a symlink, a directory or a device
  planted under its name) is an error, never followed and never waited on.
"""
from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
import time
from contextlib import contextmanager
from typing import Iterator

from .base import Deadline, StoreError, StoreTimeout
from .filekeys import LEN_BYTES, LOCK, TEMP, frame, lock_stripe, unframe

TEMP_MAX_AGE = 60.0
"""Seconds after which a temp file is taken to be left by a killed writer and removed."""

# A planted symlink fails to open (ELOOP); a planted FIFO or device opens without blocking, and
# fstat then refuses it.
_SAFE_OPEN = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


class DirFiles:
    """The key, temp and lock files of the store directory ``path`` (shown as ``where``),
    each operation on the directory's fd."""

    def __init__(self, path: str, where: str) -> None:
        self.path = path
        self.where = where

    def lock_fd(self, dir_fd: int, stripe: int) -> int:
        return self._open_regular(dir_fd, f"{LOCK}{stripe:02d}", None, os.O_RDWR | os.O_CREAT)

    def _open_regular(self, dir_fd: int, name: str, key: str | None, flags: int) -> int:
        """Open ``name`` in ``dir_fd``: a regular file only, a symlink never followed."""
        try:
            fd = os.open(name, flags | _SAFE_OPEN, 0o600, dir_fd=dir_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise self._not_regular(name, key, "a symlink") from None
            raise
        self._check_regular(fd, name, key)
        return fd

    def _check_regular(self, fd: int, name: str, key: str | None) -> None:
        """Close ``fd`` and raise unless it is a regular file."""
        try:
            mode = os.fstat(fd).st_mode
        except BaseException:
            os.close(fd)
            raise
        if not stat.S_ISREG(mode):
            os.close(fd)
            kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
            raise self._not_regular(name, key, kind)

    def _not_regular(self, name: str, key: str | None, kind: str) -> StoreError:
        of = f" of key {key!r}" if key is not None else ""
        return StoreError(
            f"{name}{of} in {self.where} is {kind}, not a regular file: something other than "
            f"elastictk put it there; remove it (and check who can write {self.path})")

    def open_key(self, dir_fd: int, key: str | None, name: str) -> int:
        """Open a key file for reading: regular files only, symlinks never followed."""
        return self._open_regular(dir_fd, name, key, os.O_RDONLY)

    @contextmanager
    def locked(self, dir_fd: int, key: str, timeout: float) -> Iterator[None]:
        """Hold the key's stripe lock. Polls with a short backoff, so it can time out: a holder
        that is stopped (SIGSTOP) or a hung filesystem gives an error, not a hang."""
        fd = self.lock_fd(dir_fd, lock_stripe(key))
        try:
            deadline = Deadline(timeout)
            pause = 0.0002
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline.expired():
                        raise StoreTimeout(
                            f"timed out after {timeout:g}s waiting for the lock on "
                            f"key {key!r} in {self.where}; another participant holds it "
                            "(stopped, or the filesystem hangs): resume or kill it"
                        ) from None
                    time.sleep(min(pause, deadline.remaining() or 0.0))
                    pause = min(pause * 2, 0.005)
            yield
        finally:
            os.close(fd)  # also releases the lock

    def read(self, dir_fd: int, key: str, name: str) -> bytes | None:
        data = b""
        for attempt in range(3):
            try:
                fd = self.open_key(dir_fd, key, name)
            except FileNotFoundError:
                return None
            except OSError as e:
                if e.errno == errno.ESTALE and attempt < 2:  # NFS: replaced under our feet
                    continue
                raise
            try:
                chunks = []
                while chunk := os.read(fd, 1 << 20):
                    chunks.append(chunk)
                data = b"".join(chunks)
                break
            except OSError as e:
                if e.errno == errno.ESTALE and attempt < 2:
                    continue
                raise
            finally:
                os.close(fd)
        return unframe(key, name, data, self.where)

    def write(self, dir_fd: int, key: str, name: str, value: bytes, durable: bool) -> None:
        value = frame(key, name, value)
        while True:
            tmp = f"{TEMP}{os.getpid()}.{secrets.token_hex(8)}"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            try:
                view = memoryview(value)
                while view:
                    view = view[os.write(fd, view):]
                if durable:
                    os.fsync(fd)
            except BaseException:
                os.close(fd)
                _unlink_quietly(tmp, dir_fd)
                raise
            os.close(fd)
            try:
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except FileNotFoundError:
                continue  # collected as stale by a peer with a skewed clock: write it again
            if durable:
                os.fsync(dir_fd)  # the rename itself survives a power loss
            return

    def hashed_key(self, dir_fd: int, name: str) -> str | None:
        """The key a hashed file holds (None: gone meanwhile)."""
        try:
            fd = self.open_key(dir_fd, None, name)
        except FileNotFoundError:
            return None
        try:
            n = int.from_bytes(os.pread(fd, LEN_BYTES, 0), "big")
            return os.pread(fd, n, LEN_BYTES).decode("utf-8", "surrogatepass")
        finally:
            os.close(fd)


def exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def collect_temp(dir_fd: int, names: list[str]) -> None:
    """Remove temp files old enough to have been left by a killed writer."""
    now = time.time()
    for name in names:
        if not name.startswith(TEMP):
            continue
        try:
            if now - os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime > TEMP_MAX_AGE:
                os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass


def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


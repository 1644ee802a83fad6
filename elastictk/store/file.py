"""A store in a directory on local disk or a shared filesystem (NFS): no server to lose.

A single-host job, or a cluster whose nodes share an NFS mount, can rendezvous through plain
files: there is no process whose death takes the store down, so the store must stay correct when
*any* participant is SIGKILLed in the middle of *any* operation. The layout makes that hold
(file names and framing: ``filekeys``; the file operations: ``filesafe``):

- One file per key, ``k.<percent-escaped key>`` (keys may contain ``/``; a key too long for a
  file name lives in ``h.<sha256>`` with the key stored in front of the value).
- Every write goes to a private temp file ``t.<pid>.<random>``, is fsynced, then ``os.replace``\\ d
  over the key file: readers see the old value or the new one, never part of one, and need no
  lock. A writer killed before the rename leaves only a temp file, which never shows up as a key
  and is removed once it is older than ``filesafe.TEMP_MAX_AGE``.
- Writes and read-modify-writes (``set``, ``add``, ``compare_set``, ``delete``) hold an
  exclusive ``flock`` on one of ``filekeys.LOCK_STRIPES`` lock files, picked by a hash of the key, so
  processes working on different keys rarely serialize. The kernel drops a ``flock`` when its
  holder dies, so a killed participant never leaves a stale lock; an ``add`` that returned has
  renamed its new value into place, so it is never lost.
- ``wait``/``get`` wake on inotify events for the directory and also re-check on a backoff
  capped at :data:`POLL_CAP`, because inotify does not see writes made by other NFS clients.
- With ``durable=True`` (the default) each write fsyncs the value, then, after the rename, the
  directory, so a value ``set`` returned with survives a power loss; ``delete`` fsyncs the
  directory after the unlink the same way.

The directory is trusted only when it is private: owned by the current user and not writable
by group or others (a directory the store creates itself is mode 0700). A key or lock file that
is not a regular file (a FIFO, a symlink, a directory or a device planted under its name) is an
error, never followed and never waited on.
"""
from __future__ import annotations

import os
import time
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from .._paths import owner_problem
from . import _inotify
from .base import DEFAULT_TIMEOUT, Deadline, Store, StoreClosed, StoreError
from .filekeys import HASHED, key_file, key_of, names_prefix
from .filesafe import TEMP_MAX_AGE, DirFiles, collect_temp, exists

POLL_CAP = 0.05
"""Longest pause between re-checks while waiting, so NFS writers from other hosts are seen."""

class _Handles:
    """The fds a store holds, closable from a finalizer without keeping the store alive."""

    def __init__(self, dir_fd: int) -> None:
        self.dir_fd = dir_fd
        self.watch: _inotify.DirWatch | None = None
        self.watch_pid = 0

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()  # in a forked child this closes only the child's copy
            self.watch = None
        if self.dir_fd >= 0:
            fd, self.dir_fd = self.dir_fd, -1
            os.close(fd)


class FileStore(Store):
    """A :class:`Store` in directory ``path`` (created mode 0700 if missing; files mode 0600).

    ``durable=False`` skips the fsync of each written value and of the directory after its
    rename: faster, still never torn by a killed process, but a power loss may leave an empty
    key file or roll a key back to an earlier value. ``watch=False`` turns off
    inotify and waits by polling alone (what happens anyway where inotify is unavailable).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        timeout: float = DEFAULT_TIMEOUT,
        *,
        durable: bool = True,
        watch: bool = True,
    ) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.default_timeout = timeout
        self.durable = durable
        self.use_watch = watch
        self._files = DirFiles(self.path, self.describe())
        self._handles = _Handles(self._open_dir())
        self._finalizer = weakref.finalize(self, self._handles.close)
        self._next_gc = 0.0
        try:  # fail now, with one clear line, where the directory is not writable
            os.close(self._files.lock_fd(self._dir, 0))
            self._collect_temp(os.listdir(self._dir))
        except StoreError:
            self.close()
            raise
        except OSError as e:
            self.close()
            raise self._path_error(e) from None

    # -- opening -------------------------------------------------------------------------------
    def _open_dir(self) -> int:
        try:
            if not os.path.isdir(self.path):
                os.makedirs(self.path, mode=0o700, exist_ok=True)
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileExistsError, NotADirectoryError):
            blocker = self.path
            while not os.path.exists(blocker) and os.path.dirname(blocker) != blocker:
                blocker = os.path.dirname(blocker)
            raise self._path_error(f"{blocker} is not a directory") from None
        except OSError as e:
            raise self._path_error(e) from None
        try:
            self._check_private(os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_private(self, st: os.stat_result) -> None:
        """Refuse a directory another user could plant files in or swap keys of."""
        problem = owner_problem(self.path, st)
        if problem is not None:
            raise StoreError(f"cannot use {self.path} for a file store: {problem} (a missing one is "
                             "created mode 0700)")

    def _path_error(self, problem: str | OSError) -> StoreError:
        if isinstance(problem, PermissionError):
            reason = "permission denied"
            fix = f"use a directory that user id {os.geteuid()} can write, or fix its permissions"
        else:
            reason = problem if isinstance(problem, str) else problem.strerror or str(problem)
            fix = "pass a path to a writable directory (it is created if missing)"
        return StoreError(f"cannot use {self.path} for a file store: {reason}; {fix}")

    @property
    def _dir(self) -> int:
        if self._handles.dir_fd < 0:
            raise StoreClosed(f"{self.describe()} is closed")
        return self._handles.dir_fd

    # -- files ---------------------------------------------------------------------------------
    @contextmanager
    def _op(self, what: str, key: str | None = None) -> Iterator[int]:
        """The directory fd; turns an OS error into one line naming the store and the key."""
        dir_fd = self._dir
        try:
            yield dir_fd
        except StoreError:
            raise
        except OSError as e:
            on = f" of key {key!r}" if key is not None else ""
            raise StoreError(
                f"{what}{on} in {self.describe()} failed: {e.strerror or e}; check that the "
                "directory still exists, is writable and its filesystem is not full"
            ) from None

    def _collect_temp(self, names: list[str]) -> None:
        """Remove temp files old enough to have been left by a killed writer."""
        self._next_gc = time.monotonic() + TEMP_MAX_AGE / 2
        collect_temp(self._dir, names)

    @contextmanager
    def _locked(self, dir_fd: int, key: str) -> Iterator[None]:
        with self._files.locked(dir_fd, key, self.default_timeout):
            yield

    # -- the Store primitives ------------------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        with self._op("set", key) as d, self._locked(d, key):
            self._files.write(d, key, key_file(key), bytes(value), self.durable)

    def try_get(self, key: str) -> bytes | None:
        with self._op("get", key) as d:
            return self._files.read(d, key, key_file(key))

    def add(self, key: str, amount: int) -> int:
        name = key_file(key)
        with self._op("add", key) as d, self._locked(d, key):
            current = self._files.read(d, key, name)
            try:
                value = int(current.decode("ascii")) if current is not None else 0
            except (UnicodeDecodeError, ValueError):
                raise StoreError(
                    f"add on key {key!r} in {self.describe()}: it holds {(current or b'')[:32]!r}, not a "
                    "decimal counter; use another key for the counter"
                ) from None
            value += int(amount)
            self._files.write(d, key, name, str(value).encode("ascii"), self.durable)
            return value

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes | None:
        name, exp = key_file(key), expected or b""
        with self._op("compare_set", key) as d, self._locked(d, key):
            current = self._files.read(d, key, name)
            if (not current) if not exp else current == exp:  # b"" also matches absent/empty
                self._files.write(d, key, name, bytes(desired), self.durable)
                return bytes(desired)
            return current

    def delete(self, key: str) -> bool:
        with self._op("delete", key) as d, self._locked(d, key):
            try:
                os.unlink(key_file(key), dir_fd=d)
            except FileNotFoundError:
                return False
            if self.durable:
                os.fsync(d)
            return True

    def get(self, key: str, timeout: float | None = None) -> bytes:
        found: list[bytes] = []

        def ready() -> bool:
            value = self.try_get(key)
            if value is not None:
                found.append(value)
            return value is not None

        self._await(ready, [key], self._timeout(timeout))
        return found[0]

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        names = [key_file(k) for k in keys]

        def ready() -> bool:
            with self._op("wait") as d:
                return all(exists(d, n) for n in names)

        self._await(ready, keys, self._timeout(timeout))

    def keys(self, prefix: str = "") -> list[str]:
        want = names_prefix(prefix)
        out: list[str] = []
        with self._op("keys") as d:
            names = os.listdir(d)
            for name in names:
                if name.startswith(want):
                    out.append(key_of(name))
                elif name.startswith(HASHED):
                    key = self._files.hashed_key(d, name)
                    if key is not None and key.startswith(prefix):
                        out.append(key)
            if time.monotonic() >= self._next_gc:
                self._collect_temp(names)
        return out

    def clone(self) -> "FileStore":
        if self._handles.dir_fd < 0:
            raise StoreClosed(f"{self.describe()} is closed")
        return _reopen(self.path, self.default_timeout, self.durable, self.use_watch)

    def close(self) -> None:
        self._finalizer()

    def describe(self) -> str:
        return f"file://{self.path}"

    def __reduce__(self) -> tuple[object, ...]:
        """Picklable as its path and settings, so a spawned worker can open the same store."""
        return (_reopen, (self.path, self.default_timeout, self.durable, self.use_watch))

    # -- waiting -------------------------------------------------------------------------------
    def _watch(self) -> _inotify.DirWatch | None:
        h = self._handles
        if not self.use_watch:
            return None
        if h.watch_pid != os.getpid():  # first use, or we are a forked child: our own watch
            if h.watch is not None:
                h.watch.close()
            h.watch = _inotify.open_watch(self.path, _inotify.IN_MOVED_TO)
            h.watch_pid = os.getpid()
        return h.watch

    def _await(self, ready: Callable[[], bool], keys: Sequence[str], timeout: float) -> None:
        """Re-check ``ready`` on every directory event and on a backoff capped at POLL_CAP."""
        deadline = Deadline(timeout)
        watch = self._watch()
        pause = 0.002
        while True:
            if watch is not None:
                watch.drain()  # before the check, so a change during it still wakes us
            if ready():
                return
            remaining = deadline.remaining() or 0.0
            if remaining <= 0:
                raise self._timeout_error(keys, timeout)
            if watch is not None:
                watch.wait(min(pause, remaining))
            else:
                time.sleep(min(pause, remaining))
            pause = min(pause * 2, POLL_CAP)


def _reopen(path: str, timeout: float, durable: bool, watch: bool) -> FileStore:
    return FileStore(path, timeout, durable=durable, watch=watch)


"""Paths elastictk writes where a user points it or where others can write: one rule for all.

Another local user who creates a directory first (in a shared ``/tmp``, say) owns what is in
it: they can plant a symlink where a report or a log will be written (and the writer, maybe
root, overwrites the link's target), plant a module where an interpreter looks for one, or
rename a run's directory away. So, as the FileStore requires of its directory and the disk
tier of its steps (``store/file.py``, ``snapshot/trust.py``):

- an existing directory named by the user (``--report-dir``, ``--log-dir``) must be a
  directory of this user that nobody else can write (:func:`check_own_dir`); a directory made
  here is made mode 0700, whatever the umask (:func:`make_own_dir`);
- the directory a single file goes in (``--event-log``, a replayed report) must pass the same
  rule, or be a sticky directory of root or this user, such as ``/tmp``, where nobody else can
  remove or rename what this user puts there (:func:`check_file_dir`); the file itself must then
  be this user's own (:func:`open_append`, :func:`check_own_file`);
- files are written into a fresh ``mkstemp`` name (``O_EXCL|O_NOFOLLOW``) and renamed into
  place (:func:`write_file`), or opened ``O_NOFOLLOW`` and checked with ``fstat``
  (:func:`open_append`): a planted symlink is replaced or refused, never followed.

Standard library only: every layer may use it (it sits beside the layers, as ``_safejson``).
Every refusal is :class:`Unsafe`, one line naming the path, its owner and mode, and the fix.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

DIR_MODE = 0o700


class Unsafe(ValueError):
    """A path that is not this user's to write in; the message is one line with the fix."""


def shared_sticky(mode: int) -> bool:
    """A sticky directory every user may write in (``/tmp``, mode 1777)."""
    return bool(mode & stat.S_ISVTX and mode & stat.S_IWOTH)


def private_subdir_fix(path: str | os.PathLike[str], flag: str = "") -> str:
    """The fix offered for a shared sticky directory: a private subdirectory of it, never making
    it unwritable for everyone else (``flag``: how the user names it, e.g. ``--snapshot-dir``)."""
    try:
        import pwd

        user = pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        user = f"uid{os.geteuid()}"
    sub = os.path.join(path, f"{user}-elastictk")
    return f"a private subdirectory, e.g. {flag + ' ' if flag else ''}{sub} (created mode 0700)"


def owner_problem(path: str | os.PathLike[str], st: os.stat_result, what: str = "directory") -> str | None:
    """Why ``st`` (of ``path``) is not this user's own, or writable by others; None if fine."""
    uid = os.geteuid()
    if st.st_uid != uid:
        return (f"{path} is owned by user id {st.st_uid}, not by the current user (id {uid}); another "
                f"user could plant files in it; use a {what} of your own")
    mode = stat.S_IMODE(st.st_mode)
    if shared_sticky(mode):  # /tmp: never make it unwritable for all
        return (f"{path} is writable by group or others (mode {mode:04o}: every user can write "
                f"in it); use {private_subdir_fix(path)}")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{path} is writable by group or others (mode {mode:04o}); run chmod go-w {path}, "
                f"or use a private {what}")
    return None


def _link_problem(path: Path) -> str | None:
    """A symlink another user made (in a shared directory) can be re-pointed at any time."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, os.geteuid()):
        return (f"{path} is a symlink owned by user id {st.st_uid}, who can re-point it; "
                "name the directory itself")
    return None


def dir_problem(path: str | os.PathLike[str], what: str = "directory") -> str | None:
    """Why the existing directory ``path`` is not one this user may write in, or None."""
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as e:
        return f"{p}: {e.strerror or e}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{p} is not a directory"
    return _link_problem(p) or owner_problem(p, st, what)


def check_own_dir(path: str | os.PathLike[str], what: str = "directory") -> None:
    """Raise :class:`Unsafe` unless ``path`` is an existing directory of this user that nobody
    else can write."""
    problem = dir_problem(path, what)
    if problem is not None:
        raise Unsafe(problem)


def make_own_dir(path: str | os.PathLike[str], what: str = "directory") -> Path:
    """``path`` and its missing parents made mode 0700; then ``path`` must pass
    :func:`check_own_dir` (an existing one is never changed: it is not ours to change)."""
    p = Path(path)
    missing: list[Path] = []
    for d in (p, *p.parents):
        if os.path.lexists(d):
            break
        missing.append(d)
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile: judged below (only the last one matters)
        os.chmod(d, DIR_MODE)
    check_own_dir(p, what)
    return p


def _shared_sticky(st: os.stat_result) -> bool:
    """A sticky directory of root or this user (``/tmp``): others may add files to it, but none
    can remove or rename this user's."""
    return bool(st.st_mode & stat.S_ISVTX) and st.st_uid in (0, os.geteuid())


def check_file_dir(path: str | os.PathLike[str], what: str = "directory") -> None:
    """The directory a file of this user's goes in: :func:`check_own_dir`'s rule, or a shared
    sticky directory (the file itself is then checked when it is opened)."""
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as e:
        raise Unsafe(f"{p}: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode) and _shared_sticky(st) and _link_problem(p) is None:
        return
    check_own_dir(p, what)


def check_own_file(path: str | os.PathLike[str]) -> None:
    """Raise :class:`Unsafe` unless ``path`` (followed) is a regular file of this user that
    nobody else can write, in a directory that passes :func:`check_file_dir`: what this user
    will act on (a report to replay) was written by this user and nobody changed it since."""
    p = Path(path)
    real = Path(os.path.realpath(p))
    for d in {p.absolute().parent, real.parent}:
        check_file_dir(d)
    problem = _link_problem(p)
    if problem is not None:
        raise Unsafe(problem)
    try:
        st = os.stat(real)
    except OSError as e:
        raise Unsafe(f"{p}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise Unsafe(f"{p} is not a regular file")
    problem = owner_problem(p, st, "file")
    if problem is not None:
        raise Unsafe(problem)


def write_file(path: str | os.PathLike[str], data: bytes | str, mode: int = 0o644) -> Path:
    """Write ``data`` to ``path`` through a fresh ``O_EXCL|O_NOFOLLOW`` temporary name in the
    same directory, renamed into place: a symlink planted at ``path`` is replaced, never
    followed, and a reader never sees half a file."""
    p = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode & ~_umask())
            f.write(raw)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return p


def open_append(path: str | os.PathLike[str], mode: int = 0o600) -> int:
    """An ``O_APPEND`` fd of ``path``, created if missing. An existing file must be a regular
    file or FIFO of this user, or a character device (only root makes those: ``/dev/null``).
    A symlink is followed only when root or this user made it (``/dev/stderr``); one another
    user planted is refused, and so is a regular file it leads to outside :func:`check_file_dir`'s
    rule. What was opened is checked again with ``fstat``, as it may have changed meanwhile."""
    follow = False
    try:  # named first: the kernel's protected_symlinks/regular would only say EACCES
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (0, os.geteuid()):
                raise Unsafe(f"{path} is a symlink owned by user id {st.st_uid}, who can re-point "
                             "it; remove it (nothing is written through another user's link)")
            follow = True
        else:
            _check_appendable(path, st)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags if follow else flags | os.O_NOFOLLOW, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Unsafe(f"{path} is a symlink; remove it (nothing is written through a link "
                         "another user can re-point)") from None
        raise
    try:
        st = os.fstat(fd)
        _check_appendable(path, st)
        if follow and stat.S_ISREG(st.st_mode):
            check_file_dir(os.path.dirname(os.path.realpath(path)))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_appendable(path: str | os.PathLike[str], st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise Unsafe(f"{path} is a symlink; remove it (nothing is written through a link "
                     "another user can re-point)")
    if stat.S_ISCHR(st.st_mode):
        return  # a device node: only root can make one
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
        raise Unsafe(f"{path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise Unsafe(f"{path} is owned by user id {st.st_uid}, not by the current user "
                     f"(id {os.geteuid()}); remove it or write elsewhere")


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` would, for every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022

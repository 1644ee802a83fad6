"""Process lifetimes: workers die with their agent, and a worker's whole tree can be found and killed.

Three Linux mechanisms, used together:

- ``PR_SET_PDEATHSIG`` in each worker: the kernel signals the worker when its parent exits, even
  by SIGKILL. It fires when the parent *thread* that forked the worker exits, so workers must be
  started from a long-lived thread (the agent's main loop). A parent that died before the prctl
  is caught by re-checking ``getppid`` right after it.
- ``PR_SET_CHILD_SUBREAPER`` in the agent: grandchildren orphaned by a dead worker are reparented
  to the agent (not to init), so the agent can still find, kill and reap them.
- One session per worker (``setsid``): the session id and process group id equal the worker's
  pid, so a worker's descendants stay findable by id even after the worker itself is gone.

The child-side helpers run between fork and exec or at the top of a worker, so they import only
the standard library; psutil is imported lazily by the agent-side helpers.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import os
import select
import signal
import time
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Optional

if TYPE_CHECKING:
    import psutil

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37

_libc = ctypes.CDLL(None, use_errno=True)
# Resolved once at import so a forked child (e.g. in ``preexec_fn``) calls it without ctypes setup.
_prctl = _libc.prctl
_prctl.restype = ctypes.c_int
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({what}) failed: {os.strerror(err)}")


def set_death_signal(sig: int) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent thread exits."""
    _check(_prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0), "PR_SET_PDEATHSIG")


def set_child_subreaper(on: bool = True) -> None:
    """Make orphaned descendants of this process reparent to it instead of init."""
    _check(_prctl(PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0), "PR_SET_CHILD_SUBREAPER")


def is_child_subreaper() -> bool:
    flag = ctypes.c_int(0)
    rc = _prctl(PR_GET_CHILD_SUBREAPER, ctypes.addressof(flag), 0, 0, 0)
    _check(rc, "PR_GET_CHILD_SUBREAPER")
    return bool(flag.value)


# The subreaper flag is per process; groups share it. The first to need it turns it on, the last
# to close restores what was there, so a process that stops supervising stops adopting orphans.
_subreaper_users = 0
_subreaper_was_on = False


def acquire_subreaper() -> None:
    global _subreaper_users, _subreaper_was_on
    if _subreaper_users == 0:
        _subreaper_was_on = is_child_subreaper()
        if not _subreaper_was_on:
            set_child_subreaper(True)
    _subreaper_users += 1


def release_subreaper() -> None:
    global _subreaper_users
    _subreaper_users = max(0, _subreaper_users - 1)
    if _subreaper_users == 0 and not _subreaper_was_on:
        set_child_subreaper(False)


def _ppid_of(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 4, after the parenthesised command name (which may itself contain spaces or ')').
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def parent_is(expected: int) -> bool:
    """True when ``expected`` is this process's parent or grandparent (a fork server between)."""
    ppid = os.getppid()
    return ppid == expected or (ppid > 1 and _ppid_of(ppid) == expected)


def die_with_parent(expected_parent: int, sig: int) -> None:
    """Child side: take ``sig`` when the parent dies; if it already died, take it now.

    Safe in ``preexec_fn``: only a pre-resolved prctl, getppid and a /proc read.
    """
    set_death_signal(sig)
    if not parent_is(expected_parent):  # the parent died before the prctl took effect
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)


def dies_with_caller() -> "Callable[[], None]":
    """A ``preexec_fn`` for helper servers (etcd, prometheus, launched agents): the child is
    SIGKILLed when the thread calling this exits, so start it from a long-lived thread."""
    return functools.partial(die_with_parent, os.getpid(), int(signal.SIGKILL))


# -- agent side --------------------------------------------------------------------------------

def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a process group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def worker_tree(live_workers: Iterable[int], sessions: Iterable[int]) -> "dict[int, psutil.Process]":
    """Every process that belongs to these workers, keyed by pid (the workers themselves excluded).

    That is the descendants of each live worker, plus this process's own children (and their
    descendants) whose session or process group is one of ``sessions``: grandchildren orphaned
    by a worker that already exited, reparented here because this process is a subreaper.
    """
    import psutil

    live = set(live_workers)
    sids = set(sessions)
    out: dict[int, psutil.Process] = {}

    def add_with_descendants(p: psutil.Process) -> None:
        out[p.pid] = p
        try:
            for c in p.children(recursive=True):
                out.setdefault(c.pid, c)
        except psutil.Error:
            pass

    for pid in live:
        try:
            for c in psutil.Process(pid).children(recursive=True):
                out.setdefault(c.pid, c)
        except psutil.Error:
            pass
    try:
        mine = psutil.Process().children(recursive=False)
    except psutil.Error:
        mine = []
    for c in mine:
        if c.pid in out or c.pid in live:
            continue
        try:
            if os.getsid(c.pid) in sids or os.getpgid(c.pid) in sids:
                add_with_descendants(c)
        except OSError:
            continue
    for pid in live:
        out.pop(pid, None)
    return out


def signal_procs(procs: "Iterable[psutil.Process]", sig: int) -> None:
    """Signal each process, skipping those gone (psutil checks the pid was not reused)."""
    import psutil

    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def signal_trees(live: "Mapping[int, Callable[[int], object]]", sessions: Iterable[int],
                 sig: int) -> "list[psutil.Process]":
    """``sig`` to every process of these workers' sessions: each session's process group at
    once, a worker not yet leading its own group through its own ``live[pid](sig)``, and
    descendants that left the group one by one. Returns the descendants found (to wait for)."""
    sessions = list(sessions)
    tree = worker_tree(list(live), sessions)
    grouped = {sid for sid in sessions if signal_group(sid, sig)}
    for pid, send in live.items():
        if pid not in grouped:
            send(sig)
    others = []
    for p in tree.values():
        try:
            if os.getpgid(p.pid) in grouped:
                continue
        except OSError:
            continue
        others.append(p)
    signal_procs(others, sig)
    return list(tree.values())


def wait_gone(procs: "Iterable[psutil.Process]", timeout: float) -> "list[psutil.Process]":
    """Block until every process has exited (pidfd readiness, no polling); the survivors."""
    import psutil

    fds: dict[int, psutil.Process] = {}
    try:
        for p in procs:
            try:
                fd = os.pidfd_open(p.pid)
            except ProcessLookupError:
                continue
            if not p.is_running():  # pid reused between snapshot and pidfd_open
                os.close(fd)
                continue
            fds[fd] = p
        deadline = time.monotonic() + max(0.0, timeout)
        while fds:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                ready, _, _ = select.select(list(fds), [], [], remaining)
            except InterruptedError:
                continue
            for fd in ready:
                os.close(fd)
                fds.pop(fd)
        return list(fds.values())
    finally:
        for fd in fds:
            os.close(fd)


def reap_orphans(sessions: Iterable[int], skip: Iterable[int] = ()) -> list[int]:
    """Reap this process's exited children that belong to ``sessions`` (orphaned grandchildren).

    Only pids found in those sessions are waited for, so children owned by ``subprocess`` or
    ``multiprocessing`` objects elsewhere in the agent are never stolen. Returns reaped pids.
    """
    import psutil

    sids = set(sessions)
    skipped = set(skip)
    reaped: list[int] = []
    try:
        mine = psutil.Process().children(recursive=False)
    except psutil.Error:
        return reaped
    for c in mine:
        if c.pid in skipped:
            continue
        try:
            if os.getsid(c.pid) not in sids and os.getpgid(c.pid) not in sids:
                continue
            pid, _ = os.waitpid(c.pid, os.WNOHANG)
        except ChildProcessError:
            continue
        except OSError as e:
            if e.errno in (errno.ESRCH, errno.ECHILD):
                continue
            raise
        if pid:
            reaped.append(pid)
    return reaped


def send_signal(pidfd: int, sig: int) -> bool:
    """Signal a process through its pidfd (immune to pid reuse); False when it has exited."""
    try:
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except ProcessLookupError:
        return False

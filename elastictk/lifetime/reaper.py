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

Process hygiene on the agent side, with PID reuse in mind (a PID, and so a session or process
group id, names a process only until the last process holding it is reaped):

- Signals reach only processes proven to be a worker's (:class:`TrackedSession`): ``killpg`` of
  a worker's session id only while the worker itself is held (alive, or a zombie not yet
  reaped), everything else through pidfds opened on processes verified by parent links or
  session membership while the session was provably the worker's. A replaced worker's session
  is reached only through such pinned members, never by its (maybe reused) id.
- Orphans are reaped (:func:`reap_orphans`): zombies reparented to the agent are waited for by
  PID, whatever their session, except children someone here owns (claimed workers and helpers).

The child-side helpers run between fork and exec or at the top of a worker, so they import only
the standard library.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import os
import signal
import sys
import time
from typing import Callable, Iterable, Mapping, Optional

from .handle import ProcessHandle
from .procfs import ProcStat, ProcUnreadable, own_children, read_stat, snapshot, stat
from .ready import readable

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


PR_SET_NAME = 15


def set_name(name: str) -> None:
    """This thread's name in ``/proc/<pid>/comm`` (what ``top``/``ps -o comm``/``pgrep`` show),
    cut to the kernel's 15 bytes. Never raises: a title is for people, not for correctness."""
    buf = ctypes.create_string_buffer(name.encode(errors="replace")[:15])
    _prctl(PR_SET_NAME, ctypes.addressof(buf), 0, 0, 0)


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


def parent_is(expected: int) -> bool:
    """True when ``expected`` is this process's parent or grandparent (a fork server between)."""
    ppid = os.getppid()
    if ppid == expected:
        return True
    st = read_stat(ppid) if ppid > 1 else None
    return st is not None and st.ppid == expected


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
    """Send ``sig`` to a process group; False when the group no longer exists.

    Only for an id known to be held (see :class:`TrackedSession`): ``killpg`` on an id whose
    processes are all gone may reach a stranger that was given the id since."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


class Tree:
    """One ``/proc`` snapshot: every process's stat, and each PID's children.

    When ``/proc`` cannot be listed (the agent out of file descriptors) the tree is empty and
    one line says so (at most once a minute): nothing new is pinned, so nothing is signalled on
    a guess, while what was pinned before (by pidfd) and the workers' own groups are still
    reached. An agent out of descriptors goes on and reports its workers' outcome; it never
    dies of a ``/proc`` listing.
    """

    def __init__(self, stats: Optional[Mapping[int, ProcStat]] = None) -> None:
        if stats is None:
            try:
                stats = snapshot()
            except ProcUnreadable as e:
                _unlisted(e)
                stats = {}
        self.stats = dict(stats)
        self.kids: dict[int, list[int]] = {}
        for pid, st in self.stats.items():
            self.kids.setdefault(st.ppid, []).append(pid)


_SAID_EVERY = 60.0
_said_at: list[float] = []  # when the last "cannot list /proc" line was printed


def _unlisted(e: OSError) -> None:
    now = time.monotonic()
    if _said_at and now - _said_at[0] < _SAID_EVERY:
        return
    _said_at[:] = [now]
    print(f"elastictk: {e.strerror}; processes the workers started since the last look are not "
          "tracked until it can be (the workers themselves still are); raise the open-file limit "
          "(ulimit -n)", file=sys.stderr, flush=True)


def _running(st: ProcStat) -> bool:
    return st.state not in ("Z", "X")


class TrackedSession:
    """One worker's session and every process verified to belong to it, each pinned by pidfd.

    The worker (``leader``, PID = session id S) leads its own session. Three rules decide what a
    signal may reach; nothing else is ever signalled:

    - ``killpg(S)`` only while the leader is *held*: alive, or a zombie its owner has not
      reaped yet (the group reaps its own children, and the preload server keeps a worker a
      zombie until the group closes that worker's status pipe). A zombie keeps its PID, process
      group id and session id allocated, so S cannot have been given to anyone else, and the
      group signalled is the worker's. Once the owner lets the leader go
      (:meth:`release_leader`), S is never passed to ``killpg`` again.
    - A *member* is pinned (a :class:`ProcessHandle`: pidfd, start time checked after opening it)
      when it is, in a ``/proc`` snapshot, (a) a child of a process already pinned here that is
      still running after the child was pinned (a running parent keeps its PID, so the snapshot's
      parent link named it: descendants that called ``setsid`` or changed group are kept), or
      (b) in session S while the session is *proven* to be the worker's after the candidate was
      pinned: the leader is held, or a pinned member is still running in session S (a process
      cannot leave a session and come back, so S stayed allocated to this session from the
      snapshot to the check and the snapshot's S was this session). Members are signalled only
      through their pidfds, so an exited member's PID, reused or not, is never signalled.
    - So a session whose leader is gone is reached only through members pinned earlier (at the
      worker's exit, while the leader was still a zombie, every process of the session is
      pinned) and processes proven to be with them. If every pinned process of a session has
      exited, the session is left alone: its id may name a stranger's session by now.

    Residual gap: a process that joined the session after the last snapshot, whose pinned
    ancestors all exited before the next one, is not found (no id can prove it is ours).
    """

    def __init__(self, leader: ProcessHandle) -> None:
        self.sid = leader.pid
        self.leader = leader
        self.members: dict[int, ProcessHandle] = {}
        self._released = False

    def release_leader(self) -> None:
        """The leader was reaped (or is about to be): its id is no longer held."""
        self._released = True

    def leader_held(self) -> bool:
        """Whether ``killpg(S)`` may be sent: False also when ``/proc`` cannot tell now."""
        try:
            return not self._released and self.leader.held()
        except ProcUnreadable:
            return False

    def _proven(self) -> bool:
        """:meth:`proven`, or :class:`~.procfs.ProcUnreadable` when ``/proc`` cannot tell."""
        if not self._released and self.leader.held():
            return True
        for h in self.members.values():
            st = stat(h.pid)
            if st is not None and st.session == self.sid and h.same_process():
                return True
        return False

    def proven(self) -> bool:
        """Session S is still this worker's session now (see the class docstring); False when
        ``/proc`` cannot tell (so nothing is pinned on its word)."""
        try:
            return self._proven()
        except ProcUnreadable:
            return False

    def finished(self) -> bool:
        """Nothing of this session is left to track: the leader let go or gone, and no pinned
        member still in the session. False while ``/proc`` cannot tell: only ENOENT/ESRCH say a
        process is gone, never running out of file descriptors."""
        try:
            return not self._proven()
        except ProcUnreadable:
            return False

    def _pin_children(self, tree: Tree, parents: "list[ProcessHandle]") -> list[ProcessHandle]:
        new: list[ProcessHandle] = []
        queue = list(parents)
        while queue:
            parent = queue.pop()
            for pid in tree.kids.get(parent.pid, ()):
                st = tree.stats[pid]
                if pid in self.members or pid == self.sid or not _running(st):
                    continue
                h = ProcessHandle.pin(pid, st.start_time)
                if h is None:
                    continue
                if not parent.same_process():  # the snapshot's parent link may name another
                    h.close()
                    continue
                self.members[pid] = h
                new.append(h)
                queue.append(h)
        return new

    def refresh(self, tree: Tree) -> None:
        """Pin what ``tree`` shows of this session and of its pinned processes' descendants;
        forget members that have exited."""
        for pid, h in list(self.members.items()):
            if h.exited():
                h.close()
                del self.members[pid]
        anchors = list(self.members.values())
        if self.leader_held() and not self.leader.exited():
            anchors.append(self.leader)
        self._pin_children(tree, anchors)
        candidates: list[ProcessHandle] = []
        for pid, st in tree.stats.items():
            if st.session != self.sid or pid == self.sid or pid in self.members or not _running(st):
                continue
            pinned = ProcessHandle.pin(pid, st.start_time)
            if pinned is not None:
                candidates.append(pinned)
        if not candidates:
            return
        if not self.proven():  # checked after pinning: see the class docstring
            for h in candidates:
                h.close()
            return
        for h in candidates:
            self.members[h.pid] = h
        self._pin_children(tree, candidates)

    def signal(self, sig: int) -> None:
        """``sig`` to the whole session as far as it is known to be this worker's."""
        grouped = self.leader_held() and signal_group(self.sid, sig)
        if not grouped and not self._released:
            self.leader.send(sig)  # not (yet) leading its own group: a function worker starting
        for h in list(self.members.values()):
            if grouped:
                st = read_stat(h.pid)
                if st is not None and st.pgrp == self.sid and h.same_process():
                    continue  # the killpg reached it
            h.send(sig)

    def close(self) -> None:
        for h in self.members.values():
            h.close()
        self.members.clear()
        self.leader.close()


def worker_tree(sessions: "Iterable[TrackedSession]") -> list[ProcessHandle]:
    """Refresh every session from one ``/proc`` snapshot; every member pinned (the workers
    themselves excluded)."""
    tree = Tree()
    out: list[ProcessHandle] = []
    for s in sessions:
        s.refresh(tree)
        out.extend(s.members.values())
    return out


def signal_trees(sessions: "Iterable[TrackedSession]", sig: int) -> list[ProcessHandle]:
    """``sig`` to every process of these workers' sessions and trees by the rules of
    :class:`TrackedSession`. Returns the members found (to wait for)."""
    sessions = list(sessions)
    members = worker_tree(sessions)
    for s in sessions:
        s.signal(sig)
    return members


def wait_gone(procs: "Iterable[ProcessHandle]", timeout: float) -> list[ProcessHandle]:
    """Block until every process has exited (pidfd readiness, no polling); the survivors."""
    fds: dict[int, ProcessHandle] = {}
    for p in procs:
        fd = p.fileno()
        if fd is not None and not p.exited():
            fds[fd] = p
    deadline = time.monotonic() + max(0.0, timeout)
    while fds:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            ready = readable(list(fds), remaining)
        except InterruptedError:
            continue
        for fd in ready:
            fds.pop(fd)
    return list(fds.values())


# Children whose exit status belongs to someone in this process (a worker's Popen, the fork
# server's, the death watch's): the orphan sweep never reaps them.
_claimed: set[int] = set()


def claim_child(pid: int) -> None:
    """Keep ``reap_orphans`` away from this child: its owner waits for it."""
    _claimed.add(pid)


def release_child(pid: int) -> None:
    _claimed.discard(pid)


def _multiprocessing_children() -> set[int]:
    import sys

    mp = sys.modules.get("multiprocessing.process")
    out: set[int] = set()
    for p in list(getattr(mp, "_children", ()) or ()):
        pid = getattr(getattr(p, "_popen", None), "pid", None)
        if pid:
            out.add(pid)
    return out


def reap_orphans(skip: Iterable[int] = ()) -> list[int]:
    """Reap this process's zombie children that nobody here owns: orphans reparented to this
    subreaper from any worker's tree (those that called ``setsid`` included). Returns reaped pids.

    Never reaped: claimed children (:func:`claim_child`; the groups claim their workers and
    helpers), ``skip``, live ``multiprocessing`` children, and children in this process's own
    session (a child started here without a session of its own belongs to whoever started it;
    no worker's descendant is in the agent's session). Each candidate is waited for by PID
    (``WNOHANG``), never ``waitpid(-1)``, and only once ``/proc`` shows it a zombie child of
    this process, so a running child's status is never taken from its owner.
    """
    me = os.getpid()
    try:
        my_sid = os.getsid(0)
    except OSError:
        return []
    keep = _claimed | set(skip)
    reaped: list[int] = []
    mp_children: Optional[set[int]] = None
    for pid in own_children():
        if pid in keep:
            continue
        st = read_stat(pid)
        if st is None or st.state != "Z" or st.ppid != me or st.session == my_sid:
            continue
        if mp_children is None:
            mp_children = _multiprocessing_children()
        if pid in mp_children:
            continue
        try:
            got, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        except OSError as e:
            if e.errno in (errno.ESRCH, errno.ECHILD):
                continue
            raise
        if got:
            reaped.append(got)
    return reaped


def send_signal(pidfd: int, sig: int) -> bool:
    """Signal a process through its pidfd (immune to pid reuse); False when it has exited."""
    try:
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except ProcessLookupError:
        return False

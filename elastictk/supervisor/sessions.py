"""Which processes are the workers': one ``TrackedSession`` per worker, and the death watch.

PIDs are reused (see ``elastictk/lifetime/reaper.py``), so a worker's session id is passed to
``killpg`` only while the worker is held (alive, or a zombie: the group reaps its own children
only when it handles their exit, and the preload server keeps a worker a zombie until the group
closes its status pipe). At the worker's exit its session's processes are pinned by pidfd;
later (a replaced worker's leftovers at ``stop``) only they and processes proven to be with them
are signalled, never the old id. ``sweep`` reaps zombies reparented to the agent (orphans of
any session, ``setsid`` or not) and forgets sessions with nothing left in them, so the death
watch never kills by an id that is free for anyone.
"""
from __future__ import annotations

import time
from typing import Optional

from ..lifetime.deathwatch import DeathWatch
from ..lifetime.handle import ProcessHandle
from ..lifetime.reaper import (
    Tree, TrackedSession, claim_child, reap_orphans, release_child, signal_group,
)

# How often the group's select loop sweeps for orphaned zombies and finished sessions.
SWEEP_EVERY = 1.0


class WorkerSessions:
    """The sessions of one attempt's workers (replaced workers' included), keyed by the
    worker's pid, and the death watch that kills them if the agent is SIGKILLed."""

    def __init__(self, death_watch: bool = True) -> None:
        self.watch = DeathWatch() if death_watch else None
        self._all: list[TrackedSession] = []
        self._of: dict[int, TrackedSession] = {}
        self._next_sweep = 0.0

    def start(self) -> None:
        """Start the death watch (idempotent)."""
        if self.watch is not None:
            self.watch.start()
            if self.watch.pid is not None:
                claim_child(self.watch.pid)

    def watch_fd(self) -> Optional[int]:
        """The agent's end of the death watch's pipe (a fork-started worker must close it)."""
        return self.watch.fileno() if self.watch is not None else None

    def add(self, pid: int) -> None:
        """A started worker, still held, so its start time is its own."""
        claim_child(pid)  # our own child (or the fork server's): reaped by its owner object
        session = TrackedSession(ProcessHandle(pid))
        self._all.append(session)
        self._of[pid] = session
        if self.watch is not None:
            self.watch.watch(pid)

    def all(self) -> list[TrackedSession]:
        return list(self._all)

    def leader_held(self, pid: int) -> bool:
        """Whether worker ``pid`` still holds its session id (so ``killpg`` reaches only it)."""
        session = self._of.get(pid)
        return session is not None and session.leader_held()

    def signal_group(self, pid: int, sig: int) -> bool:
        """``sig`` to worker ``pid``'s process group, only while it holds the id."""
        return self.leader_held(pid) and signal_group(pid, sig)

    def pin(self, pid: int) -> None:
        """Worker ``pid`` exited and is still a zombie holding its session id: pin the
        processes left in its session now, before the id is let go."""
        session = self._of.get(pid)
        if session is not None:
            session.refresh(Tree())

    def released(self, pid: int) -> None:
        """Worker ``pid`` was reaped: its id may be reused from now on."""
        session = self._of.get(pid)
        if session is not None:
            session.release_leader()

    def sweep(self, force: bool = False) -> None:
        """Reap orphaned zombies; forget finished workers' sessions with nothing left in them."""
        now = time.monotonic()
        if not force and now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_EVERY
        reap_orphans()
        for session in list(self._all):
            if session.finished():  # never on an unreadable /proc: an fd error is not a death
                self._forget(session)

    def end_attempt(self) -> None:
        """The attempt is over (everything in it killed and reaped): let every session go."""
        for session in list(self._all):
            self._forget(session)
        self._of = {}

    def _forget(self, session: TrackedSession) -> None:
        session.close()
        self._all.remove(session)
        if self.watch is not None:
            self.watch.unwatch(session.sid)

    def close(self) -> None:
        """Say goodbye to the death watch (nothing is killed) and reap it."""
        if self.watch is not None:
            pid = self.watch.pid
            self.watch.close()
            if pid is not None:
                release_child(pid)

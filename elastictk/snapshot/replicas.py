"""Replicas this agent holds of other nodes' parts: anonymous memory, bounded, the newest kept.

Each replica lives in a ``memfd`` of its own (nothing in ``/dev/shm``; it dies with this agent)
sized to the part, so a part is received straight into the memory that keeps it. At most
:data:`KEEP` steps are kept per (rank, world size); the bytes of all replicas together stay
within ``--snapshot-memory`` (a replica that does not fit is refused in one line by the
caller). A replica in use by a sender is closed only once the send is done.

What is kept follows the job's membership (:func:`stale`): a replica of another world size is
no use to anyone (a part restores only the same rank in the same world size) and goes at once;
one whose origin left the job is kept through the next round (its replacement restores from
it) and dropped when the round moves on again, or as soon as the rank's new owner sends a part
of its own.
"""
from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass, field
from typing import Iterable, Optional

from .settings import human

KEEP = 1  # the newest whole step per rank: 2 local slots + 1 replica = 3x the state per node
MEMFD_NAME = "elastictk-replica"


class NoRoom(RuntimeError):
    """A replica does not fit the memory bound; the message names the sizes."""


@dataclass(frozen=True)
class Key:
    origin: str  # node id of the agent that sent it
    rank: int
    world: int
    step: int


def stale(held: Iterable[Key], members: set[str], previous: set[str], world: int) -> set[Key]:
    """Replicas to drop when a round of ``world`` ranks with ``members`` begins, the round
    before having had ``previous`` (pure)."""
    return {k for k in held if k.world != world or (k.origin not in members and k.origin not in previous)}


def superseded(held: Iterable[Key], new: Key) -> set[Key]:
    """What keeping ``new`` drops (pure): the same rank's parts sent by another node (the rank
    moved there), all but the newest :data:`KEEP` steps, and an older copy of ``new`` itself."""
    same = [k for k in held if (k.rank, k.world) == (new.rank, new.world)]
    out = {k for k in same if k.origin != new.origin or k == new}
    mine = sorted((k for k in same if k.origin == new.origin and k != new), key=lambda k: k.step, reverse=True)
    return out | set(mine[KEEP - 1:])


@dataclass(eq=False)
class Replica:
    key: Key
    digest: int
    length: int
    _fd: int
    _mm: Optional[mmap.mmap]
    users: int = 0
    dropped: bool = False
    kept: bool = field(default=False)

    def data(self) -> memoryview:
        assert self._mm is not None
        return memoryview(self._mm)[:self.length]

    def _close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view still exported: the mapping goes with the last one
                pass
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Replicas:
    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        self._held: dict[Key, Replica] = {}
        self._pending: set[Replica] = set()

    def used(self) -> int:
        return sum(r.length for r in self._held.values()) + sum(r.length for r in self._pending)

    def reserve(self, key: Key, digest: int, length: int) -> Replica:
        """Memory for a replica about to be received; :class:`NoRoom` if it cannot fit even
        after the replicas keeping it would drop."""
        if length < 0:  # messages.put_request refuses it; the budget arithmetic must never see one
            raise ValueError(f"a replica of {length} bytes")
        with self._lock:
            freed = sum(self._held[k].length for k in superseded(self._held, key))
            if self.used() - freed + length > self.budget:
                raise NoRoom(f"a replica of rank {key.rank}'s step {key.step} ({human(length)}) does "
                             f"not fit: {human(self.used() - freed)} of {human(self.budget)} "
                             "(--snapshot-memory) held; raise --snapshot-memory")
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, max(length, 1))
                mm = mmap.mmap(fd, max(length, 1))
            except OSError:
                os.close(fd)
                raise
            rep = Replica(key, digest, length, fd, mm)
            self._pending.add(rep)
            return rep

    def keep(self, rep: Replica) -> list[Key]:
        """Make a received, verified replica available; the keys it dropped."""
        with self._lock:
            self._pending.discard(rep)
            gone = superseded(self._held, rep.key)
            for k in gone:
                self._drop(k)
            self._held[rep.key] = rep
            rep.kept = True
            return sorted(gone, key=lambda k: (k.rank, k.step))

    def discard(self, rep: Replica) -> None:
        with self._lock:
            self._pending.discard(rep)
            rep._close()

    def _drop(self, k: Key) -> None:
        rep = self._held.pop(k, None)
        if rep is not None:
            rep.dropped = True
            if rep.users == 0:
                rep._close()

    def index(self) -> list[Key]:
        with self._lock:
            return sorted(self._held, key=lambda k: (k.rank, k.world, k.step))

    def borrow(self, rank: int, world: int, step: int) -> Optional[Replica]:
        """A held replica for sending; :meth:`give_back` when done."""
        with self._lock:
            for k, rep in self._held.items():
                if (k.rank, k.world, k.step) == (rank, world, step):
                    rep.users += 1
                    return rep
            return None

    def give_back(self, rep: Replica) -> None:
        with self._lock:
            rep.users -= 1
            if rep.dropped and rep.users == 0:
                rep._close()

    def on_round(self, members: set[str], previous: set[str], world: int) -> list[Key]:
        with self._lock:
            gone = stale(self._held, members, previous, world)
            for k in gone:
                self._drop(k)
            return sorted(gone, key=lambda k: (k.origin, k.rank, k.step))

    def close(self) -> None:
        with self._lock:
            for k in list(self._held):
                self._drop(k)
            for rep in list(self._pending):
                rep._close()
            self._pending.clear()

"""Replicas this agent holds of other nodes' parts: anonymous memory, bounded, the newest kept.

Each replica lives in an anonymous shared mapping of its own, sized to the part (nothing in
``/dev/shm``, no file descriptor: it dies with this agent), so a part is received straight into
the memory that keeps it and a thousand replicas cost no descriptor the agent needs for its
workers, stores and ``/proc``. At most :data:`KEEP` steps are mapped per (rank, world size,
origin), kept and arriving together. A newer part arrives beside the one kept, which stays once
the new one is whole and verified until the new step is whole on *every* node of the round
(``hold()`` says whether to wait for that; :meth:`Replicas.settle` asks, with the round's
counters, :mod:`.cadence`): a send cut short (its sender lost mid-send, the very case a replica
exists for) never costs the last whole replica, and a node lost while the others' parts of the
new step are still on their way leaves their older step whole everywhere, for the restore to
agree on. So a node holds its two local slots and one replica at rest, 3x the state, and 4x from
the start of an arrival until every node's part of that step is whole; a third part arriving
for the same rank drops the oldest first, so never more. The bytes of all replicas, kept and
arriving, stay within ``--snapshot-replica-memory`` (by default ``--snapshot-memory``) at every
instant (the one about to be superseded counts until it goes). A bound that holds one part of a
rank but not two (set for 3x per node) makes the kept replica go *before* its successor
arrives, said once per sender: until the new part is whole this node holds none of that rank,
the price of the fourth copy saved. The replicas are counted too, not only their bytes (at most
:data:`MAX_REPLICAS`; a part of zero bytes is refused before it gets here). One peer (one sender
address) may hold at most :data:`MAX_PEER_REPLICAS` of them and have at most half the memory
bound reserved for parts still arriving (:data:`PEER_INFLIGHT`; the round's ring sender of an
origin, one part at a time, more), so a token holder who reserves parts and trickles their
bytes leaves room for honest ones. A replica that does not fit is
refused in one line by the caller. A replica in use by a sender is closed only once the send is
done.

What is kept follows the job's membership (:func:`stale`): a replica of another world size is
no use to anyone (a part restores only the same rank in the same world size) and goes at once;
one whose origin left the job is kept through the next round (its replacement restores from
it) and dropped when the round moves on again, or as soon as the rank's new owner sends a part
of its own.
"""
from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from .settings import human

KEEP = 2  # steps per (rank, world, origin): the newest whole one, and the one before until it is whole everywhere
MAX_REPLICAS = 1024  # replicas held or arriving, from all peers together
MAX_PEER_REPLICAS = 256  # ... from one peer (a node ships its local ranks x KEEP: 8 x 2 typically)
PEER_INFLIGHT = 0.5  # of the memory bound, the most one peer may have reserved for arriving parts


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
    _mm: Optional[mmap.mmap]
    peer: str = ""  # the address it came from: per-peer limits count it there
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


def older(held: Iterable[Key], new: Key) -> list[Key]:
    """The same sender's replicas of ``new``'s rank and world older than it (pure)."""
    return sorted((k for k in held if (k.origin, k.rank, k.world) == (new.origin, new.rank, new.world)
                   and k.step < new.step), key=lambda k: k.step)


class Replicas:
    """``hold()``: whether a replica that a newer one of its rank replaced stays until the newer
    step is whole everywhere (:meth:`settle`); without it (or while it says no) it goes at once."""

    def __init__(self, budget: int, max_replicas: int = MAX_REPLICAS,
                 max_peer_replicas: int = MAX_PEER_REPLICAS, hold: Optional[Callable[[], bool]] = None,
                 warn: Optional[Callable[[str, str], None]] = None,
                 sender: Optional[Callable[[str, str], bool]] = None) -> None:
        """``warn(cause, line)``: said once per cause (the peer tier's), for a bound so tight that
        a replica goes before its successor arrives. ``sender(origin, peer)``: whether ``peer``
        (an address) is where this round's ring has ``origin`` ship its parts to this node
        from; such a sender's part, alone in flight, may take more than half of the bound."""
        self.budget, self.max_replicas, self.max_peer_replicas = budget, max_replicas, max_peer_replicas
        self.hold = hold
        self.warn = warn
        self.sender = sender
        self.tight = 0  # replicas dropped before their successor arrived, for want of room
        self._lock = threading.Lock()
        self._held: dict[Key, Replica] = {}
        self._pending: set[Replica] = set()
        self._waiting: dict[tuple[str, int, int], int] = {}  # (origin, rank, world) -> the step to be whole

    def used(self) -> int:
        return sum(r.length for r in self._held.values()) + sum(r.length for r in self._pending)

    def count(self) -> int:
        """Replicas held or arriving."""
        with self._lock:
            return len(self._held) + len(self._pending)

    def reserve(self, key: Key, digest: int, length: int, peer: str = "") -> Replica:
        """Memory for a replica about to be received from ``peer`` (its address);
        :class:`NoRoom` if it does not fit beside what is held and arriving (the replica it
        supersedes included: that one stays whole until this one is), or if it would pass a
        count or per-peer limit (the message names which, and the values)."""
        if length < 0:  # messages.put_request refuses it; the budget arithmetic must never see one
            raise ValueError(f"a replica of {length} bytes")
        with self._lock:
            self._make_room(key)
            self._make_tight_room(key, length)
            self._check_limits(key, length, peer)
            mm = mmap.mmap(-1, max(length, 1))  # MAP_SHARED|MAP_ANONYMOUS: shmem, no descriptor
            rep = Replica(key, digest, length, mm, peer)
            self._pending.add(rep)
            return rep

    def _make_room(self, key: Key) -> None:
        """A part of a newer step arriving while :data:`KEEP` of its rank are held from its
        sender (the older one still waiting for the newer to be whole everywhere): the oldest
        goes, so at most :data:`KEEP` are mapped, kept and arriving. Under the lock."""
        mine = older(self._held, key)
        arriving = sum(1 for r in self._pending if (r.key.origin, r.key.rank, r.key.world)
                       == (key.origin, key.rank, key.world))
        newer = [k for k in self._held if (k.origin, k.rank, k.world) == (key.origin, key.rank, key.world)
                 and k.step >= key.step]
        for k in mine[:max(len(mine) + len(newer) + arriving + 1 - KEEP, 0)]:
            self._drop(k)

    def _make_tight_room(self, key: Key, length: int) -> None:
        """A bound that holds one part of a rank but not two (``--snapshot-replica-memory`` sized
        for one replica: 3x the state per node): the replica this part supersedes goes before it
        arrives, so it fits, and one line says what that costs. Under the lock."""
        mine = older(self._held, key)
        if not mine or self.used() + length <= self.budget:
            return
        freed = sum(self._held[k].length for k in mine)
        if self.used() - freed + length > self.budget:
            return  # it would not fit either way: refused by the byte check, in its own line
        need = self.used() + length  # to keep them beside it
        for k in mine:
            self._drop(k)
        self.tight += 1
        if self.warn is not None:
            self.warn(f"tight {key.origin}", (
                f"the replica of rank {key.rank}'s step {mine[-1].step} from {key.origin} was dropped "
                f"before step {key.step} arrives: {human(self.budget)} of replica memory holds one "
                f"part of it ({human(length)}), not two; until the new part is whole this node "
                "holds no replica of that rank, so a sender lost mid-send loses its state here; "
                f"for a whole replica throughout give --snapshot-replica-memory at least "
                f"{human(need)}"))

    def _check_limits(self, key: Key, length: int, peer: str) -> None:
        """:class:`NoRoom` unless a reservation for ``key`` fits every limit. Bytes and counts are
        strict: a replica about to be superseded still counts until it is dropped (it still holds
        its mapping until the new one is whole), so the replicas' mapped bytes never pass
        their bound, also while one arrives beside the one it replaces."""
        if self.used() + length > self.budget:
            raise NoRoom(f"a replica of rank {key.rank}'s step {key.step} ({human(length)}) does "
                         f"not fit: {human(self.used())} of {human(self.budget)} "
                         "(--snapshot-replica-memory, by default --snapshot-memory) held or arriving; "
                         "raise it")
        if len(self._held) + len(self._pending) >= self.max_replicas:
            raise NoRoom(f"a replica of rank {key.rank}'s step {key.step} refused: {self.max_replicas} "
                         "replicas held or arriving already (the most this agent keeps)")
        mine = [r for r in self._held.values() if r.peer == peer]
        arriving = [r for r in self._pending if r.peer == peer]
        if len(mine) + len(arriving) >= self.max_peer_replicas:
            raise NoRoom(f"a replica of rank {key.rank}'s step {key.step} refused: {peer or 'this peer'} "
                         f"holds {self.max_peer_replicas} replicas here already (the most one peer may)")
        inflight = sum(r.length for r in arriving)
        # The ring's sender of this origin, one part at a time, may take more than half (a node
        # of one rank under a bound of one part): the limit is on any other peer reserving
        # parts and trickling their bytes.
        ring = not arriving and self.sender is not None and self.sender(key.origin, peer)
        if not ring and inflight + length > self.budget * PEER_INFLIGHT:
            raise NoRoom(f"a replica of rank {key.rank}'s step {key.step} ({human(length)}) refused: "
                         f"{peer or 'this peer'} has {human(inflight)} arriving already, and one peer may "
                         f"have at most half of the replicas' bound ({human(self.budget)}) arriving")

    def keep(self, rep: Replica) -> list[Key]:
        """Make a received, verified replica available; the keys it dropped. The older replica
        of its rank it replaces stays while ``hold()`` says so, until :meth:`settle` finds the
        new step whole everywhere."""
        hold = self.hold is not None and self.hold()
        with self._lock:
            self._pending.discard(rep)
            gone = superseded(self._held, rep.key)
            if not hold:
                gone |= set(older(self._held, rep.key))
            for k in gone:
                self._drop(k)
            self._held[rep.key] = rep
            rep.kept = True
            slot = (rep.key.origin, rep.key.rank, rep.key.world)
            if hold and older(self._held, rep.key):
                self._waiting[slot] = rep.key.step
            else:
                self._waiting.pop(slot, None)
            return sorted(gone, key=lambda k: (k.rank, k.step))

    def waiting(self) -> set[int]:
        """The steps whose older replicas stay until they are whole everywhere."""
        with self._lock:
            return set(self._waiting.values())

    def settle(self, whole: Callable[[int], bool]) -> list[Key]:
        """Drop the older replicas of every rank whose newer step ``whole(step)`` says is whole on
        every node (asked once per step, outside the lock); the keys dropped."""
        steps = self.waiting()
        done = {s for s in steps if whole(s)}
        gone: list[Key] = []
        with self._lock:
            for slot, step in list(self._waiting.items()):
                newest = Key(slot[0], slot[1], slot[2], step)
                if newest not in self._held:
                    del self._waiting[slot]  # dropped meanwhile (a round, a newer part)
                elif step in done:
                    del self._waiting[slot]
                    for k in older(self._held, newest):
                        self._drop(k)
                        gone.append(k)
        return gone

    def discard(self, rep: Replica) -> None:
        with self._lock:
            self._pending.discard(rep)
            rep._close()

    def _drop(self, k: Key) -> None:
        slot = (k.origin, k.rank, k.world)
        if self._waiting.get(slot) == k.step:
            del self._waiting[slot]
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

"""The agent's side of the peer tier: ship sealed slots to ring neighbours, fetch lost parts back.

The training process never does network I/O for this tier. Its agent owns the memory the
commits land in (:class:`~.local.Holder`), so the agent is what ships them: a worker that has
sealed a slot (checksummed it) writes one byte to a pipe the agent reads
(``ELASTICTK_SNAPSHOT_NOTIFY``), and the agent's replicator thread (:mod:`.replicator`: which
steps, each kept whole while it is sent) sends its local ranks' parts to the next
``--snapshot-replicas`` nodes of the round's ring (:func:`~.ring.ring_targets`) over an
authenticated connection (:mod:`.peer`).

Restore needs no worker change either: before a round's workers start, the agent asks every
other member what it holds (``index``, one request per node: its replicas and the steps in its
own local slots), works out the newest step every rank of the world has somewhere
(:func:`~.ring.agreed_fetch`), and for each local rank lacking that step locally fetches it
(``get``), verifies it and adopts it into the rank's older local slot, naming where it came from.
The workers' restore then finds it as it finds any local part; the ranks agree on the newest
step every rank holds whole, wherever it came from (e.g. a spare that replaced a lost host
restores from its neighbour's replica, and the survivors from their own memory).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Mapping, Optional, Protocol, Sequence

from .cadence import RoundKeys, RoundStore
from .codec import checksum
from .lag import LagCollector, ReplicaLag
from .local import READY, SLOTS, Holder, Region
from .peer import PeerClient, PeerServer
from .replicas import Key, Replicas
from .replicator import Endpoint, Replicator
from .ring import agreed_fetch, ring_targets
from .settings import human
from .messages import endpoint
from .wire import WireError
from ..store.base import StoreError

log = logging.getLogger("elastictk.snapshot")
META_PORT = "snapshot_peer"  # the key of the server's port in the agent's join record
CONNECT_TIMEOUT = 5.0  # connect + handshake; also each index/get exchange at a round's start
PUT_TIMEOUT = 60.0  # each exchange of a put, its bytes having this plus their size at wire.MIN_RATE
SELF: Endpoint = ("", "this agent", 0)  # a replica this agent holds itself


class Member(Protocol):
    """A round's member as the rendezvous reports it (its join record's meta included)."""

    @property
    def node_id(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def meta(self) -> Mapping[str, Any]: ...


class PeerTier:
    """One agent's peer tier: server, replicas, replicator; ``close()`` ends them all."""

    def __init__(self, holder: Holder, host: str, token: Optional[str], job: str, replicas: int,
                 memory: int) -> None:
        """``memory``: the replicas' bound (``--snapshot-replica-memory``, by default the local
        tier's ``--snapshot-memory``)."""
        self.key = token.encode() if token else None
        self.job, self.count = job, replicas
        self._warned: set[str] = set()
        self._sources: set[tuple[str, str]] = set()  # (origin, address) this round ships to us from
        self.replicas = Replicas(memory, hold=self._holding, warn=self._warn,
                                 sender=lambda origin, peer: (origin, peer) in self._sources)
        self.server = PeerServer(host, self.replicas, self.key, job, on_kept=self._kept, local=self._local_index)
        self.regions = [Region(holder.path, lr, holder.region, holder.memory, holder.n)
                        for lr in range(holder.n)]
        self.lag = ReplicaLag()
        self._previous: set[str] = set()
        self._ship = Replicator(self.regions, self.replicas, self.lag, self._connect_put, self._warn,
                                rate=_test_rate())

    @property
    def cadence(self) -> int:
        """The job's cadence as this agent last knew it (this round)."""
        return self._ship.cadence

    @property
    def rate(self) -> float:
        """Bytes/s the sends are held to: tests slow them down; 0 in a job."""
        return self._ship.rate

    @rate.setter
    def rate(self, rate: float) -> None:
        self._ship.rate = rate

    def meta(self) -> dict[str, Any]:
        """What goes into this agent's (sealed) join record: where its server listens."""
        return {META_PORT: self.server.port}

    def collector(self) -> LagCollector:
        """The replica-lag gauge, for the agent's metrics registry."""
        return LagCollector(self.lag)

    def env(self) -> dict[str, str]:
        """The workers' environment: where they say they sealed a slot."""
        return self._ship.env()

    def poke(self) -> None:
        """Wake the replicator."""
        self._ship.poke()

    def _warn(self, cause: str, line: str) -> None:
        if cause not in self._warned:
            self._warned.add(cause)
            log.warning("snapshot peer tier: %s", line)

    def _connect(self, e: Endpoint) -> PeerClient:
        """An authenticated connection to ``e``'s server: :data:`CONNECT_TIMEOUT` to connect and
        shake hands, and for each exchange."""
        return PeerClient(e[1], e[2], self.key, self.job, timeout=CONNECT_TIMEOUT)

    def _connect_put(self, e: Endpoint) -> PeerClient:
        """The replicator's connection to ``e``, whose exchanges may each take :data:`PUT_TIMEOUT`."""
        c = self._connect(e)
        c.timeout = PUT_TIMEOUT
        return c

    # -- rounds -----------------------------------------------------------------------------------
    def round(self, members_: Sequence[Member], world: int, node_id: str, base_rank: int,
              prefetch: bool, store: Optional[RoundStore] = None) -> None:
        """A round begins: drop replicas nobody can use, aim the ring, and (workers about to
        start) fetch this node's ranks' parts that peers hold and this node does not. ``store``:
        the round's own keys (``RoundInfo.store``), for the cadence and the whole-step counters;
        without one this agent keeps its own cadence and drops a replaced replica at once."""
        members = sorted(members_, key=lambda m: m.rank)
        ids = {m.node_id for m in members}
        gone = self.replicas.on_round(ids, self._previous, world)
        if gone:
            log.info("snapshot peer tier: dropped %d replica(s) of nodes no longer in the job: %s",
                     len(gone), ", ".join(sorted({k.origin for k in gone})))
        self._previous = ids
        ends: list[Optional[Endpoint]] = []
        for m in members:
            where = endpoint(m.meta, META_PORT)
            ends.append(None if where is None else (m.node_id, *where))
        pos = next(i for i, m in enumerate(members) if m.node_id == node_id)
        targets = [e for p in ring_targets(pos, len(members), self.count) if (e := ends[p]) is not None]
        self._sources = {(e[0], e[1]) for i, e in enumerate(ends)
                         if e is not None and pos in ring_targets(i, len(members), self.count)}
        senders = sum(1 for e in ends if e is not None) if len(members) > 1 else 0
        keys = self._round_keys(store, node_id, senders)
        self._ship.aim(node_id, targets, keys, paused=prefetch)
        try:
            if prefetch:
                others = [e for i, e in enumerate(ends) if e is not None and i != pos]
                self._prefetch(others, base_rank, world)
        finally:
            self._ship.resume()

    def _round_keys(self, store: Optional[RoundStore], node_id: str, senders: int) -> Optional[RoundKeys]:
        if store is None or senders < 2:  # alone in its round: nothing ships, nothing to share
            return None
        try:
            own = store.clone()  # the replicator's own connection
        except (StoreError, OSError) as e:
            self._warn("store clone", f"no connection to the round's store ({e}); this node ships on "
                       "its own cadence and drops a replaced replica at once")
            return None
        return RoundKeys(own, node_id, senders)

    def _prefetch(self, others: list[Endpoint], base_rank: int, world: int) -> None:
        clients: dict[Endpoint, PeerClient] = {}
        local: dict[int, set[int]] = {}  # rank -> steps its holder keeps in its local slots
        offers: dict[int, dict[int, list[Endpoint]]] = {}  # rank -> step -> who holds a replica
        mine = {base_rank + lr: lr for lr in range(len(self.regions))}
        for k in self.replicas.index():  # this agent's own replicas first: no network
            if k.world == world:
                offers.setdefault(k.rank, {}).setdefault(k.step, []).append(SELF)
        for rank, lr in mine.items():
            local[rank] = {m.step for m in self.regions[lr].ready(rank, world) if m.checked}
        try:
            for e in others:
                try:
                    c = clients[e] = self._connect(e)
                    replicas, held = c.holdings()
                except (WireError, OSError) as err:
                    self._warn(f"index {e[1]}", f"cannot ask {e[1]}:{e[2]} for replicas: {err}")
                    continue
                for k in replicas:
                    if k.world == world:
                        offers.setdefault(k.rank, {}).setdefault(k.step, []).append(e)
                for h in held:
                    if h.world == world and h.rank not in mine:
                        local.setdefault(h.rank, set()).add(h.step)
            common, plan = agreed_fetch(world, local, offers, mine)
            if common is None and any(plan.values()):
                log.info("snapshot peer tier: no step is held by every rank of the world, locally or "
                         "as a replica; fetching this node's ranks' newest parts")
            for rank, fetches in sorted(plan.items()):
                for step, holder in fetches:
                    self._fetch(clients.get(holder), self.regions[mine[rank]], holder, rank, world, step)
        finally:
            for c in clients.values():
                c.close()

    def _fetch(self, client: Optional[PeerClient], region: Region, e: Endpoint, rank: int, world: int,
               step: int) -> None:
        t0 = time.monotonic()
        raw: bytes | bytearray
        try:
            if e == SELF or client is None:
                raw, digest = self._own(rank, world, step)
                where = "a replica this agent held"
            else:
                raw, digest = client.get(rank, world, step, limit=region.slot_size)  # verified
                where = f"peer {e[1]}"
            took = (time.monotonic() - t0) * 1000
            region.adopt(step, memoryview(raw), rank, world, origin=f"{where} (fetched by the agent in {took:.1f} ms)",
                         digest=digest, slot=region.evictable(rank, world))
        except Exception as err:  # a torn or missing part, no room: the restore agrees without it
            self._warn(f"fetch {rank} {step}", f"rank {rank}'s step {step} not fetched from {e[1]}: {err}")
            return
        log.info("snapshot peer tier: fetched rank %d's step %d (%s) from %s in %.1f ms",
                 rank, step, human(len(raw)), e[1], took)

    def _own(self, rank: int, world: int, step: int) -> tuple[bytes, int]:
        """A replica this agent holds, copied and verified."""
        rep = self.replicas.borrow(rank, world, step)
        if rep is None:
            raise WireError(f"rank {rank}'s step {step} is no longer held here")
        try:
            raw, digest = bytes(rep.data()), rep.digest
        finally:
            self.replicas.give_back(rep)
        if checksum(raw) != digest:
            raise WireError(f"this agent's replica of rank {rank}'s step {step} is torn")
        return raw, digest

    def _kept(self, key: Key, gone: list[Key]) -> None:
        if any(k.origin != key.origin for k in gone):
            log.info("snapshot peer tier: rank %d now comes from %s; dropped the replicas of %s",
                     key.rank, key.origin, ", ".join(sorted({k.origin for k in gone if k.origin != key.origin})))
        if self.replicas.waiting():
            self.poke()  # the replicator asks once whether the new step is whole everywhere

    def _holding(self) -> bool:
        """Whether a replaced replica waits for its newer step to be whole everywhere
        (:meth:`.replicator.Replicator.holding`)."""
        return self._ship.holding()

    def _local_index(self) -> list[dict[str, Any]]:
        """The steps this node holds in its local slots, ready and checksummed (``index``)."""
        out = []
        for region in self.regions:
            for i in range(SLOTS):
                m = region.meta(i)
                if m.state == READY and m.checked and 0 < m.length <= region.slot_size and 0 <= m.rank < m.world:
                    out.append({"rank": m.rank, "world": m.world, "step": m.step})
        return out

    def close(self) -> None:
        self._ship.stop()
        self.server.close()
        self.replicas.close()
        for r in self.regions:
            r.close()
        self._ship.close()


ENV_THROTTLE = "ELASTICTK_SNAPSHOT_TEST_SEND_BPS"  # tests only: ship at most this many bytes/s


def _test_rate() -> float:
    """A send rate for tests that need sends slower than the steps (a real network's pace, on a
    loopback that is not): the replicator waits ``nbytes / rate`` before each put. 0: none."""
    try:
        rate = float(os.environ.get(ENV_THROTTLE, "") or 0)
    except ValueError:
        return 0.0
    return rate if rate > 0 and rate != float("inf") else 0.0

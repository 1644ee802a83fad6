"""The agent's side of the peer tier: ship sealed slots to ring neighbours, fetch lost parts back.

The training process never does network I/O for this tier. Its agent owns the memory the
commits land in (:class:`~.local.Holder`), so the agent is what ships them: a worker that has
sealed a slot (checksummed it) writes one byte to a pipe the agent reads
(``ELASTICTK_SNAPSHOT_NOTIFY``), and the agent's replicator thread sends each local rank's
newest sealed slot to the next ``--snapshot-replicas`` nodes of the round's ring
(:func:`~.ring.ring_targets`) over an authenticated connection (:mod:`.peer`). A slot
overwritten while it is being sent arrives torn and is refused by its checksum; the newer
one follows.

Restore needs no worker change either: before a round's workers start, the agent asks every
other member what replicas it holds (``index``, one request per node) and, for each local rank
whose newest steps are held by a peer and not here, fetches them (``get``), verifies them and
adopts them into that rank's local slots, naming where they came from. The workers' restore
then finds them as it finds any local part; the ranks agree on the newest step every rank holds
whole, wherever it came from (e.g. a spare that replaced a lost host restores from its
neighbours' replicas).
"""
from __future__ import annotations

import logging
import os
import select
import threading
import time
from typing import Any, Mapping, Optional, Protocol, Sequence

from .lag import LagCollector, ReplicaLag
from .local import READY, Holder, Region
from .peer import PeerClient, PeerServer
from .replicas import Key, Replicas
from .ring import ring_targets, to_fetch
from .settings import ENV_NOTIFY, human
from .messages import endpoint
from .wire import WireError

log = logging.getLogger("elastictk.snapshot")
META_PORT = "snapshot_peer"  # the key of the server's port in the agent's join record
CONNECT_TIMEOUT = 5.0  # connect + handshake; also each index/get exchange at a round's start
PUT_TIMEOUT = 60.0  # each exchange of a put, its bytes having this plus their size at wire.MIN_RATE
Endpoint = tuple[str, str, int]  # node id, address, port


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
        self.key = token.encode() if token else None
        self.job, self.count = job, replicas
        self.replicas = Replicas(memory)
        self.server = PeerServer(host, self.replicas, self.key, job, on_kept=self._kept)
        self.regions = [Region(holder.path, lr, holder.region, holder.memory, holder.n)
                        for lr in range(holder.n)]
        self._rfd, self._wfd = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._node_id = ""
        self._targets: list[Endpoint] = []
        self._clients: dict[Endpoint, PeerClient] = {}
        self._shipped: dict[int, int] = {}  # local rank -> seq of the slot last shipped
        self.lag = ReplicaLag()
        self.rate = _test_rate()  # tests slow the sends down (bytes/s); 0 in a job
        self._previous: set[str] = set()
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="elastictk-replicator", daemon=True)
        self._thread.start()

    def meta(self) -> dict[str, Any]:
        """What goes into this agent's (sealed) join record: where its server listens."""
        return {META_PORT: self.server.port}

    def collector(self) -> LagCollector:
        """The replica-lag gauge, for the agent's metrics registry."""
        return LagCollector(self.lag)

    def env(self) -> dict[str, str]:
        return {ENV_NOTIFY: f"/proc/{os.getpid()}/fd/{self._wfd}"}

    def _warn(self, cause: str, line: str) -> None:
        if cause not in self._warned:
            self._warned.add(cause)
            log.warning("snapshot peer tier: %s", line)

    # -- rounds -----------------------------------------------------------------------------------
    def round(self, members_: Sequence[Member], world: int, node_id: str, base_rank: int,
              prefetch: bool) -> None:
        """A round begins: drop replicas nobody can use, aim the ring, and (workers about to
        start) fetch this node's ranks' parts that peers hold and this node does not."""
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
        with self._lock:
            self._node_id, self._targets = node_id, targets
            for e in [e for e in self._clients if e not in targets]:
                self._clients.pop(e).close()
            self._shipped.clear()  # new neighbours get the newest parts again
            self.lag.reset()
        if prefetch:
            others = [e for i, e in enumerate(ends) if e is not None and i != pos]
            self._prefetch(others, base_rank, world)
        self.poke()

    def _prefetch(self, others: list[Endpoint], base_rank: int, world: int) -> None:
        clients: dict[Endpoint, PeerClient] = {}
        offers: dict[int, dict[int, list[Endpoint]]] = {}
        try:
            for e in others:
                try:
                    c = clients[e] = PeerClient(e[1], e[2], self.key, self.job, timeout=CONNECT_TIMEOUT)
                    for k in c.index():
                        if k.world == world:
                            offers.setdefault(k.rank, {}).setdefault(k.step, []).append(e)
                except (WireError, OSError) as err:
                    self._warn(f"index {e[1]}", f"cannot ask {e[1]}:{e[2]} for replicas: {err}")
            for lr, region in enumerate(self.regions):
                rank = base_rank + lr
                local = {m.step for m in region.ready(rank, world)}
                for step, holder in to_fetch(local, offers.get(rank, {})):
                    self._fetch(clients[holder], region, holder, rank, world, step)
        finally:
            for c in clients.values():
                c.close()

    def _fetch(self, client: PeerClient, region: Region, e: Endpoint, rank: int, world: int, step: int) -> None:
        t0 = time.monotonic()
        try:
            raw, digest = client.get(rank, world, step, limit=region.slot_size)  # verified
            took = (time.monotonic() - t0) * 1000
            region.adopt(step, memoryview(raw), rank, world,
                         origin=f"peer {e[1]} (fetched by the agent in {took:.1f} ms)", digest=digest)
        except Exception as err:  # a torn or missing part, no room: the restore agrees without it
            self._warn(f"fetch {rank} {step}", f"rank {rank}'s step {step} not fetched from {e[1]}: {err}")
            return
        log.info("snapshot peer tier: fetched rank %d's step %d (%s) from %s in %.1f ms",
                 rank, step, human(len(raw)), e[1], took)

    def _kept(self, key: Key, gone: list[Key]) -> None:
        if any(k.origin != key.origin for k in gone):
            log.info("snapshot peer tier: rank %d now comes from %s; dropped the replicas of %s",
                     key.rank, key.origin, ", ".join(sorted({k.origin for k in gone if k.origin != key.origin})))

    # -- the replicator ---------------------------------------------------------------------------
    def poke(self) -> None:
        try:
            os.write(self._wfd, b"\0")
        except BlockingIOError:
            pass

    def _run(self) -> None:
        while True:
            ready, _, _ = select.select([self._rfd, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            try:
                while os.read(self._rfd, 4096):
                    pass
            except BlockingIOError:
                pass
            while self._ship_newest():
                pass  # something newer was sealed while we sent

    def _ship_newest(self) -> bool:
        """Send each local rank's newest sealed slot not yet sent, pinned while it is sent (the
        worker's commits go to its other slot meanwhile, so the part arrives whole however long
        the send takes); whether a newer one was sealed meanwhile."""
        with self._lock:
            targets, node_id = list(self._targets), self._node_id
        again = False
        for lr, region in enumerate(self.regions):
            metas = [m for m in (region.meta(0), region.meta(1))
                     if m.state == READY and m.checked and 0 < m.length <= region.slot_size]
            if not metas or not targets:
                continue
            m = max(metas, key=lambda m: m.seq)
            self.lag.sealed(lr, m.rank, m.step)
            if self._shipped.get(lr, 0) >= m.seq or not region.pin(m):
                continue  # sent already, or overwritten between the read and the pin: the next wake
            try:
                self._shipped[lr] = m.seq
                t0 = time.monotonic()
                kept = [self._put(e, node_id, region, m) for e in targets]
                if all(kept):
                    self.lag.replicated(lr, m.step, time.monotonic() - t0)
            finally:
                region.unpin()
            newest = max((region.meta(i) for i in (0, 1)), key=lambda x: x.seq)
            if newest.seq != m.seq:
                again = True
        return again

    def _put(self, e: Endpoint, node_id: str, region: Region, m: Any) -> bool:
        """Send pinned slot ``m`` to ``e``; whether ``e`` kept it."""
        try:
            if self.rate and select.select([self._stop_r], [], [], m.length / self.rate)[0]:
                return False  # closing
            for _ in range(2):
                c = self._clients.get(e)
                pooled = c is not None
                if c is None:
                    c = self._clients[e] = PeerClient(e[1], e[2], self.key, self.job, timeout=CONNECT_TIMEOUT)
                    c.timeout = PUT_TIMEOUT
                try:
                    c.put(node_id, m.rank, m.world, m.step, m.digest, region.data(m.index)[:m.length])
                    return True
                except (WireError, OSError) as err:
                    if not pooled or (isinstance(err, WireError) and "after 0 of" not in str(err)):
                        raise
                    self._drop_client(e)  # the server closed it while it sat idle: once more, anew
            return False
        except WireError as err:
            self._warn(f"put {e[1]} {type(err).__name__}", f"rank {m.rank}'s step {m.step} not "
                       f"replicated to {e[1]}: {err}")
            if "refused" not in str(err) and "did not keep" not in str(err):
                self._drop_client(e)
        except OSError as err:
            self._warn(f"put {e[1]} os", f"cannot replicate to {e[1]}:{e[2]}: {err}")
            self._drop_client(e)
        return False

    def _drop_client(self, e: Endpoint) -> None:
        with self._lock:
            c = self._clients.pop(e, None)
        if c is not None:
            c.close()

    def close(self) -> None:
        os.write(self._stop_w, b"\0")
        self._thread.join(timeout=30)
        for c in list(self._clients.values()):
            c.close()
        self._clients.clear()
        self.server.close()
        self.replicas.close()
        for r in self.regions:
            r.close()
        for fd in (self._rfd, self._wfd, self._stop_r, self._stop_w):
            os.close(fd)


ENV_THROTTLE = "ELASTICTK_SNAPSHOT_TEST_SEND_BPS"  # tests only: ship at most this many bytes/s


def _test_rate() -> float:
    """A send rate for tests that need sends slower than the steps (a real network's pace, on a
    loopback that is not): the replicator waits ``nbytes / rate`` before each put. 0: none."""
    try:
        rate = float(os.environ.get(ENV_THROTTLE, "") or 0)
    except ValueError:
        return 0.0
    return rate if rate > 0 and rate != float("inf") else 0.0

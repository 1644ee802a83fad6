"""The agent's side of the peer tier: ship sealed slots to ring neighbours, fetch lost parts back.

The training process never does network I/O for this tier. Its agent owns the memory the
commits land in (:class:`~.local.Holder`), so the agent is what ships them: a worker that has
sealed a slot (checksummed it) writes one byte to a pipe the agent reads
(``ELASTICTK_SNAPSHOT_NOTIFY``), and the agent's replicator thread sends its local ranks' parts
to the next ``--snapshot-replicas`` nodes of the round's ring (:func:`~.ring.ring_targets`)
over an authenticated connection (:mod:`.peer`).

Every agent ships the same steps: the multiples of the job's cadence K (:mod:`.cadence`; 1,
every step, while sends are quick; raised for the whole job when a send takes longer than half
of K steps). A slot holding such a step is pinned as soon as it is sealed and stays pinned until
the next one is: the worker's commits go to its other slot meanwhile, so the part arrives whole
however long the send takes, and the step stays in this node's memory until the next shipped
one replaces it, the step its neighbour's replica of it most likely holds. A node whose targets
all kept its parts of a step says so in the round's store; receivers keep a rank's previous
replica until every node's part of the new step is whole (:meth:`.replicas.Replicas.settle`).

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
import select
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Protocol, Sequence

from .cadence import READ_EVERY, RoundKeys, RoundStore, StepClock, covering
from .codec import checksum
from .lag import LagCollector, ReplicaLag
from .local import READY, SLOTS, Holder, Region, SlotMeta
from .peer import PeerClient, PeerServer
from .replicas import Key, Replicas
from .ring import agreed_fetch, ring_targets
from .settings import ENV_NOTIFY, human
from .messages import endpoint
from .wire import WireError
from ..store.base import StoreError

log = logging.getLogger("elastictk.snapshot")
META_PORT = "snapshot_peer"  # the key of the server's port in the agent's join record
CONNECT_TIMEOUT = 5.0  # connect + handshake; also each index/get exchange at a round's start
PUT_TIMEOUT = 60.0  # each exchange of a put, its bytes having this plus their size at wire.MIN_RATE
Endpoint = tuple[str, str, int]  # node id, address, port
SELF: Endpoint = ("", "this agent", 0)  # a replica this agent holds itself
AT_REST = 1.0  # seconds without a seal (at least) before the newest commit ships off the cadence


class Member(Protocol):
    """A round's member as the rendezvous reports it (its join record's meta included)."""

    @property
    def node_id(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def meta(self) -> Mapping[str, Any]: ...


@dataclass
class _Shipping:
    """The replicator's state for one local rank in one round."""

    pinned: Optional[SlotMeta] = None  # the slot pinned: the step chosen last, kept whole here
    chosen: int = 0  # the newest step chosen this round; the next one shipped is a multiple of K above it
    sent: int = -1  # the newest step whose send was tried


@dataclass
class _Cycle:
    """One step's sends, over the local ranks."""

    tried: set[int] = field(default_factory=set)
    whole: set[int] = field(default_factory=set)
    seconds: float = 0.0


class PeerTier:
    """One agent's peer tier: server, replicas, replicator; ``close()`` ends them all."""

    def __init__(self, holder: Holder, host: str, token: Optional[str], job: str, replicas: int,
                 memory: int) -> None:
        self.key = token.encode() if token else None
        self.job, self.count = job, replicas
        self.replicas = Replicas(memory, hold=self._holding)
        self.server = PeerServer(host, self.replicas, self.key, job, on_kept=self._kept, local=self._local_index)
        self.regions = [Region(holder.path, lr, holder.region, holder.memory, holder.n)
                        for lr in range(holder.n)]
        self._rfd, self._wfd = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._node_id = ""
        self._targets: list[Endpoint] = []
        self._clients: dict[Endpoint, PeerClient] = {}
        self._gen = 0  # the round; the replicator starts over when it changes
        self._paused = False  # a round's start is fetching into the regions: nothing is pinned
        self._floors: list[int] = [0] * holder.n  # per region: the newest seq when the round began
        self._keys: Optional[RoundKeys] = None  # the round's cadence and whole-step keys
        self._retired: list[RoundKeys] = []  # earlier rounds' keys, closed by the replicator
        self.cadence = 1  # the job's cadence as this agent last knew it (this round)
        self.lag = ReplicaLag()
        self.rate = _test_rate()  # tests slow the sends down (bytes/s); 0 in a job
        self._previous: set[str] = set()
        self._warned: set[str] = set()
        # The replicator thread's own (one round's):
        self._seen = -1
        self._ranks: dict[int, _Shipping] = {}
        self._cycles: dict[int, _Cycle] = {}
        self._clock = StepClock()
        self._read_at = 0.0
        self._read_for: Optional[int] = None  # the step the cadence was last read before choosing
        self._sealed: tuple[tuple[int, int], float] = ((0, 0), 0.0)  # (newest seq, regions), when seen
        self._unshipped = False  # a newer step than the one pinned is sealed (it ships at rest)
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
        senders = sum(1 for e in ends if e is not None) if len(members) > 1 else 0
        keys = self._round_keys(store, node_id, senders)
        with self._lock:
            self._gen += 1
            self._paused = prefetch
            self._node_id, self._targets = node_id, targets
            for e in [e for e in self._clients if e not in targets]:
                self._clients.pop(e).close()
            if self._keys is not None:
                self._retired.append(self._keys)
            self._keys = keys
            self.lag.reset()
        for r in self.regions:  # the fetches and the workers' restore may use either slot
            r.unpin()
        try:
            if prefetch:
                others = [e for i, e in enumerate(ends) if e is not None and i != pos]
                self._prefetch(others, base_rank, world)
        finally:  # only what is sealed from now on ships: not a step the workers' restore gives up
            with self._lock:
                self._floors = [max(r.meta(0).seq, r.meta(1).seq) for r in self.regions]
                self._paused = False
            self.poke()

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
                    c = clients[e] = PeerClient(e[1], e[2], self.key, self.job, timeout=CONNECT_TIMEOUT)
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
        """Whether a replaced replica waits for its newer step to be whole everywhere: from K=2
        on, when the round's store says so (at K=1 a send takes under half a step)."""
        return self._keys is not None and self.cadence >= 2

    def _local_index(self) -> list[dict[str, Any]]:
        """The steps this node holds in its local slots, ready and checksummed (``index``)."""
        out = []
        for region in self.regions:
            for i in range(SLOTS):
                m = region.meta(i)
                if m.state == READY and m.checked and 0 < m.length <= region.slot_size and 0 <= m.rank < m.world:
                    out.append({"rank": m.rank, "world": m.world, "step": m.step})
        return out

    # -- the replicator ---------------------------------------------------------------------------
    def poke(self) -> None:
        try:
            os.write(self._wfd, b"\0")
        except BlockingIOError:
            pass

    def _run(self) -> None:
        while True:  # woken per seal, per kept replica, per round; once a second while one waits
            waits = [READ_EVERY] if self._keys is not None and self.replicas.waiting() else []
            if self._unshipped:
                waits.append(max(self._sealed[1] + self._at_rest() - time.monotonic(), 0.01))
            ready, _, _ = select.select([self._rfd, self._stop_r], [], [], min(waits, default=None))
            if self._stop_r in ready:
                return
            try:
                while os.read(self._rfd, 4096):
                    pass
            except BlockingIOError:
                pass
            self._work()

    def _work(self) -> None:
        """Pin newly sealed steps of the cadence, send what is pinned and not sent yet, one part
        at a time (pinning again between parts), and settle the replicas held for a whole step."""
        with self._lock:
            gen, targets, node_id, keys = self._gen, list(self._targets), self._node_id, self._keys
            retired, self._retired = self._retired, []
        for k in retired:
            k.close()
        if gen != self._seen:  # a new round: new neighbours get the newest parts again
            self._seen, self.cadence, self._read_at, self._read_for = gen, 1, 0.0, None
            self._sealed, self._unshipped = ((0, 0), time.monotonic()), False
            self._ranks = {lr: _Shipping() for lr in range(len(self.regions))}
            self._cycles.clear()
            self._clock = StepClock()
            self._read_cadence(keys)
        self._settle(keys)
        while self._pin(gen, keys) and targets:
            due = [(lr, st.pinned) for lr, st in sorted(self._ranks.items())
                   if st.pinned is not None and st.sent < st.pinned.step]
            if not due:
                return
            lr, m = due[0]
            assert m is not None
            self._send(lr, m, targets, node_id, keys)
            self._settle(keys)

    def _pin(self, gen: int, keys: Optional[RoundKeys]) -> bool:
        """Pin each local rank's newest sealed step that is a multiple of the cadence and newer
        than the one it holds (with K=1: its newest); False once a new round has begun."""
        k = self.cadence
        now = time.monotonic()
        sealed = [max((m.seq for m in (r.meta(0), r.meta(1)) if m.state == READY and m.checked), default=0)
                  for r in self.regions]
        mark = (max(sealed, default=0), sum(sealed))
        if mark != self._sealed[0]:
            self._sealed = (mark, now)
        at_rest = k > 1 and now - self._sealed[1] >= self._at_rest()  # an eval, the job's end
        self._unshipped = False
        for lr, region in enumerate(self.regions):
            st = self._ranks[lr]
            metas = [m for m in (region.meta(0), region.meta(1))
                     if m.state == READY and m.checked and 0 < m.length <= region.slot_size]
            if st.pinned is not None and not any((m.index, m.seq) == (st.pinned.index, st.pinned.seq) for m in metas):
                with self._lock:  # given up by a restore, then written anew: no longer ours to hold
                    if self._gen == gen and region.pinned == st.pinned.index:
                        region.unpin()
                st.pinned = None
            if not metas:
                continue
            newest = max(metas, key=lambda m: m.seq)
            self.lag.sealed(lr, newest.rank, newest.step)
            self._clock.saw(newest.step)
            with self._lock:
                floor = self._floors[lr]
            due = [m for m in metas if (m.step % k == 0 or (at_rest and m is newest)) and m.step > st.chosen
                   and m.seq > floor and (st.pinned is None or m.seq > st.pinned.seq)]
            if not due and k > 1 and newest.step > st.chosen and newest.seq > floor:
                self._unshipped = True
            if due and keys is not None and self._read_cadence(keys, before=max(m.step for m in due)) != k:
                k = self.cadence  # read before choosing: another agent raised it
                due = [m for m in due if m.step % k == 0 or (at_rest and m is newest)]
            if due:
                m = max(due, key=lambda m: m.seq)
                with self._lock:
                    if self._gen != gen or self._paused:
                        return False
                    pinned = region.pin(m)
                    if not pinned and st.pinned is not None:
                        region.pin(st.pinned)  # the older step stays whole here
                if pinned:
                    st.pinned, st.chosen = m, m.step
                    continue
                self._missed(st, m.rank, m.step, k)
            elif k > 1 and newest.step >= (st.chosen // k + 1) * k:  # sealed and overwritten unseen
                self._missed(st, newest.rank, newest.step // k * k, k)
        with self._lock:
            return self._gen == gen and not self._paused

    def _at_rest(self) -> float:
        """Seconds without a new seal after which the newest commit ships, whatever its step:
        four steps' time, at least :data:`AT_REST` (the job paused for an eval, or ended; every
        rank stopped at the same step, so every node ships the same one)."""
        per_step = self._clock.step_seconds()
        return max(AT_REST, 4 * per_step) if per_step else AT_REST

    def _observe(self) -> None:
        """The newest step sealed now, for the step clock."""
        newest = [m for r in self.regions for m in (r.meta(0), r.meta(1)) if m.state == READY and m.checked]
        if newest:
            self._clock.saw(max(newest, key=lambda m: m.seq).step)

    def _missed(self, st: _Shipping, rank: int, step: int, k: int) -> None:
        st.chosen = max(st.chosen, step)
        self._warn("missed", f"rank {rank}'s step {step} was overwritten before this agent could pin it "
                   f"(the job ships every {_nth(k)} step); this node skips it, so a node lost before its "
                   "next shipped step restores an older one (said once)")

    def _send(self, lr: int, m: SlotMeta, targets: list[Endpoint], node_id: str,
              keys: Optional[RoundKeys]) -> None:
        """Send pinned slot ``m`` of local rank ``lr`` to every target; the pin stays (the step
        stays whole here until the next one is pinned)."""
        st, region = self._ranks[lr], self.regions[lr]
        st.sent = m.step
        t0 = time.monotonic()
        kept = [self._put(e, node_id, region, m) for e in targets]
        took = time.monotonic() - t0
        now = [x for x in (region.meta(0), region.meta(1)) if x.state == READY and x.checked]
        if now:  # what was sealed meanwhile: the lag once the part arrived is the send's steps
            newest = max(now, key=lambda x: x.seq)
            self.lag.sealed(lr, newest.rank, newest.step)
        cycle = self._cycles.setdefault(m.step, _Cycle())
        cycle.tried.add(lr)
        cycle.seconds += took
        if all(kept):
            cycle.whole.add(lr)
            self.lag.replicated(lr, m.step, took)
        if len(cycle.tried) == len(self.regions):  # every local rank's part of this step sent
            self._observe()  # the steps sealed meanwhile: what the send cost in steps
            del self._cycles[m.step]
            for s in [s for s in self._cycles if s < m.step]:
                del self._cycles[s]
            self._raise(m.step, cycle.seconds, keys)
            if len(cycle.whole) == len(self.regions) and keys is not None and self.cadence >= 2:
                keys.mark_whole(m.step)
        self._read_cadence(keys)

    def _raise(self, step: int, seconds: float, keys: Optional[RoundKeys]) -> None:
        """A send that took more than half of K steps raises the job's cadence (:func:`covering`)."""
        per_step = self._clock.step_seconds()
        if not per_step:
            return
        steps = seconds / per_step
        k = covering(steps, self.cadence)
        if k <= self.cadence:
            return
        was = self.cadence
        stored = keys.raise_to(k) if keys is not None else None
        self.cadence = max(k, stored or 0)
        log.info("snapshot peer tier: sending step %d took %.2f s, %.1f steps of %.3f s: the job now ships "
                 "every %s step (was every %s), so every node ships the same steps and a lost node's "
                 "replica step is one the others hold too", step, seconds, steps, per_step,
                 _nth(self.cadence), _nth(was))

    def _read_cadence(self, keys: Optional[RoundKeys], before: Optional[int] = None) -> int:
        """The job's cadence, read before step ``before`` is chosen (once per step, whatever the
        local ranks) and after each send; at most every :data:`READ_EVERY` seconds while it is 1
        (a send every step)."""
        now = time.monotonic()
        fresh = before is not None and before != self._read_for and self.cadence > 1
        if keys is None or (now - self._read_at < READ_EVERY and not fresh):
            return self.cadence
        self._read_at, self._read_for = now, before if before is not None else self._read_for
        k = keys.cadence()
        if k is not None and k > self.cadence:
            log.info("snapshot peer tier: the job ships every %s step now (was every %s)", _nth(k),
                     _nth(self.cadence))
            self.cadence = k
        return self.cadence

    def _settle(self, keys: Optional[RoundKeys]) -> None:
        """Replicas held beside a newer one go once the newer step is whole everywhere (asked in
        the round's store once per step and wake-up; those of an earlier round wait for the
        rank's next part or the round after, as any replica of a node gone)."""
        if keys is not None and self.cadence >= 2 and self.replicas.waiting():
            self.replicas.settle(keys.whole)

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
        for k in [*self._retired, *([self._keys] if self._keys is not None else [])]:
            k.close()
        self._retired, self._keys = [], None
        for c in list(self._clients.values()):
            c.close()
        self._clients.clear()
        self.server.close()
        self.replicas.close()
        for r in self.regions:
            r.close()
        for fd in (self._rfd, self._wfd, self._stop_r, self._stop_w):
            os.close(fd)


def _nth(k: int) -> str:
    """``1`` -> ``"1st"`` as in "every 32nd step"; 1 reads "single"."""
    if k == 1:
        return "single"
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


ENV_THROTTLE = "ELASTICTK_SNAPSHOT_TEST_SEND_BPS"  # tests only: ship at most this many bytes/s


def _test_rate() -> float:
    """A send rate for tests that need sends slower than the steps (a real network's pace, on a
    loopback that is not): the replicator waits ``nbytes / rate`` before each put. 0: none."""
    try:
        rate = float(os.environ.get(ENV_THROTTLE, "") or 0)
    except ValueError:
        return 0.0
    return rate if rate > 0 and rate != float("inf") else 0.0

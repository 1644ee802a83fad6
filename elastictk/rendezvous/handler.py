"""The rendezvous handler an agent calls to join a job: ``next_round()`` and friends.

Joining costs each node a handful of round trips (one counter bump, one slot write, then a
blocking wait on the round's result key). One node, the earliest live arrival, closes the round
with a single compare-and-set; if it dies, the next earliest takes over. The decisions
themselves live in :mod:`elastictk.rendezvous.decide`.
"""
from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ..store import PrefixStore, Store, StoreTimeout
from .auth import ALG, Signer
from .config import RendezvousConfig
from .decide import Arrival, Close, Fail, RoundView, Wait, decide, round_to_join
from .errors import RendezvousAuthError, RendezvousClosed, RendezvousTimeout
from .liveness import Heartbeat, LivenessTracker, read_counters
from .records import (
    Member,
    NodeRecord,
    RoundResult,
    decode_node,
    decode_note,
    decode_result,
    encode_note,
    round_key,
    slot_key,
)

log = logging.getLogger("elastictk.rendezvous")


@dataclass(frozen=True)
class RoundInfo:
    """This node's place in a closed round."""

    round: int
    rank: int
    world_size: int
    members: tuple[Member, ...]
    store_prefix: str
    store: Store = field(repr=False, compare=False)

    @property
    def peers(self) -> tuple[Member, ...]:
        return self.members


def default_node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class RendezvousHandler:
    """Joins membership rounds of one job over any :class:`Store`.

    ``store`` is the job's store (shared by every node); the handler keeps its keys under
    ``rdzv/<job_id>/``. ``meta`` (JSON-able) travels to every peer with this node's record:
    its address, how many workers it runs, anything the agent needs from its peers.
    """

    def __init__(
        self,
        store: Store,
        config: RendezvousConfig,
        node_id: str | None = None,
        meta: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.node_id = node_id or default_node_id()
        self.meta = dict(meta or {})
        self.prefix = f"rdzv/{config.job_id}"
        self.store = PrefixStore(self.prefix, store)
        self._clock = clock
        self._heartbeat: Heartbeat | None = None
        self.tracker = LivenessTracker(config.heartbeat_timeout)
        self.current: RoundInfo | None = None
        self.signer = Signer(config.token)
        self._admitted = False
        self._ignored: set[str] = set()

    def _k(self, key: str) -> str:
        """The full store key (what a record's MAC covers and what errors name)."""
        return f"{self.prefix}/{key}"

    def _ignore(self, key: str, why: str) -> None:
        if key not in self._ignored:
            self._ignored.add(key)
            log.warning("ignored store key %r: %s", self._k(key), why)

    def _admit(self) -> None:
        """Stamp the job with our token mode, or check that we may join the job stamped so."""
        if self._admitted:
            return
        mine = self.note("auth", auth=ALG if self.signer.enabled else "none")
        raw = self.store.compare_set("auth", None, mine) or mine
        self.signer.admit(self._k("auth"), decode_note(self._k("auth"), raw), self.config.job_id, self.node_id)
        self._admitted = True

    @property
    def left_check(self) -> Callable[[str, bytes | None], bool] | None:
        """How a LEFT heartbeat mark is checked: None without a token (believed as is)."""
        return self.verified if self.signer.enabled else None

    def verified(self, key: str, raw: bytes | None) -> bool:
        """Whether the note at ``key`` (``lost/..``, ``shutdown``) is signed with our token;
        a forged one is ignored with a warning naming the key, never believed."""
        if raw is None:
            return False
        try:
            decode_note(self._k(key), raw, self.signer)
            return True
        except RendezvousAuthError as e:
            self._ignore(key, str(e))
            return False

    # -- joining ----------------------------------------------------------------------------
    def next_round(self) -> RoundInfo:
        """Join the next round and block until it closes; this node's rank and the membership.

        Raises :class:`RendezvousClosed` when the job has finished, :class:`RendezvousTimeout`
        when too few nodes came within the join timeout.
        """
        cfg = self.config
        deadline = self._clock() + cfg.join_timeout
        self._admit()
        self.start_heartbeat()
        floor = 1
        while True:
            self._raise_if_shut_down()
            if self._clock() >= deadline:
                raise RendezvousTimeout(
                    f"node {self.node_id} found no round of job {cfg.job_id!r} with room for it "
                    f"within the join timeout of {cfg.join_timeout:g}s (all closed at --nnodes MAX?)"
                )
            n = self._open_round(floor)
            seq = self.store.add(round_key(n, "arrivals"), 1)
            self.store.set(slot_key(n, seq), NodeRecord(self.node_id, self.meta).to_json(self.signer, self._k(slot_key(n, seq))))
            result = self._await(n, seq, deadline)
            if result.shutdown is not None:
                raise RendezvousClosed(f"job {cfg.job_id!r} has finished ({result.shutdown}); nothing to join")
            rank = result.rank_of(self.node_id)
            if rank is not None:
                self.current = RoundInfo(
                    n, rank, len(result.members), result.members,
                    f"{self.prefix}/{round_key(n, 'job')}",
                    PrefixStore(round_key(n, "job"), self.store),
                )
                return self.current
            # The round closed without us (we came after the closer counted, or past max):
            # we are now waiting for the next round, which num_nodes_waiting() reports.
            floor = n + 1

    def start_heartbeat(self) -> None:
        """Start heartbeating now instead of in the first :meth:`next_round`.

        The heartbeat has a store connection of its own. Opening one costs a few round trips,
        and a c10d client also looks up its socket's host name, a DNS query that a slow
        resolver stretches to seconds; an agent that calls this while it prepares its workers
        keeps all that off the rendezvous' critical path. Idempotent; :meth:`close` stops it.
        """
        if self._heartbeat is None:
            left = self.note(f"left/{self.node_id}", node_id=self.node_id) if self.signer.enabled else None
            self._heartbeat = Heartbeat(self.store, self.node_id, self.config.heartbeat_interval, left_note=left)

    def _open_round(self, floor: int) -> int:
        """The round to join; never below ``floor`` (a round that already closed without us)."""
        latest = self.store.add("latest", 0)  # also creates the counter, so the CAS below can match
        closed = latest > 0 and self.store.try_get(round_key(latest, "result")) is not None
        n = max(round_to_join(latest, closed), floor)
        if n > latest:
            self.store.compare_set("latest", str(latest).encode(), str(n).encode())
        return n

    def _await(self, n: int, seq: int, deadline: float) -> RoundResult:
        """Wait for round ``n``'s result; close it ourselves when we are the closer."""
        cfg = self.config
        result_key = round_key(n, "result")
        previous = self._read_result(n - 1) if n > 1 else None
        records: dict[int, Arrival | None] = {}
        opened_at, min_reached_at = self._clock(), None
        while True:
            raw = self.store.try_get(result_key)
            if raw is not None:
                return decode_result(self._k(result_key), raw, self.signer)
            now = self._clock()
            if self._closer_alive_before(n, seq, records, now):
                if now >= deadline:
                    raise RendezvousTimeout(
                        f"round {n} of job {cfg.job_id!r} did not form within the join timeout of "
                        f"{cfg.join_timeout:g}s; start more nodes or lower --nnodes MIN"
                    )
                self._wait_for([result_key], min(cfg.heartbeat_interval, deadline - now))
                continue
            # We close this round.
            count = self.store.add(round_key(n, "arrivals"), 0)
            arrivals = self._read_slots(n, records, 1, count)
            watch = [a.node_id for a in arrivals]
            if previous is not None:
                watch += [m.node_id for m in previous.members]
            dead = self._dead(sorted(set(watch) - {self.node_id}), now)
            view = RoundView(n, tuple(arrivals), previous, dead, now, opened_at, min_reached_at)
            decision = decide(view, cfg)
            if isinstance(decision, Close):
                mine = RoundResult(n, decision.members).to_json(self.signer, self._k(result_key))
                won = self.store.compare_set(result_key, None, mine)
                return decode_result(self._k(result_key), won or b"", self.signer)
            if isinstance(decision, Fail):
                raise RendezvousTimeout(decision.reason)
            assert isinstance(decision, Wait)
            min_reached_at = decision.min_reached_at
            until = min(decision.until, now + cfg.heartbeat_interval)
            # A node bumps the counter before it writes its slot. ``wake_seq`` counts on from
            # the highest written slot, so while a lower one is still unwritten it lies past
            # the last node to come; wait for that slot first, then decide again.
            hole = next((s for s in range(1, count + 1) if s not in records), None)
            wake = decision.wake_seq if hole is None else hole
            self._wait_for([slot_key(n, wake)], until - now, also=result_key)

    def _closer_alive_before(self, n: int, seq: int, cache: dict[int, Arrival | None], now: float) -> bool:
        """Whether an earlier arrival than us is alive to close the round.

        Slots are read from the first on, in batches of 1, 2, 4, ... and only until a live
        one turns up, and only that node's ``lost/`` key is read: normally slot 1 holds the
        live closer, so a waiting node costs the store O(1) small reads per heartbeat, not
        a read of every earlier slot and a listing of every key.
        """
        lo, size = 1, 1
        while lo <= seq:
            hi = min(seq, lo + size - 1)
            for a in self._read_slots(n, cache, lo, hi):
                if a.node_id == self.node_id:
                    return False
                lost = self.verified(f"lost/{a.node_id}", self.store.try_get(f"lost/{a.node_id}"))
                if not lost and not self._dead([a.node_id], now, set()):
                    return True
            lo, size = hi + 1, size * 2
        return False

    def _read_slots(self, n: int, cache: dict[int, Arrival | None], lo: int, hi: int) -> list[Arrival]:
        """Slots lo..hi that are written (a node bumps the counter before it writes its
        slot); records never change, so each is read once."""
        missing = [s for s in range(lo, hi + 1) if s not in cache]
        if missing:
            for s, raw in zip(missing, self.store.multi_get([slot_key(n, s) for s in missing])):
                if raw is not None:
                    try:
                        rec = decode_node(self._k(slot_key(n, s)), raw, self.signer)
                    except RendezvousAuthError as e:  # a stranger's join: never counted
                        self._ignore(slot_key(n, s), str(e))
                        cache[s] = None
                        continue
                    cache[s] = Arrival(s, rec.node_id, rec.meta)
        return [a for a in (cache.get(s) for s in range(lo, hi + 1)) if a is not None]

    def _lost(self) -> set[str]:
        keys = self.store.keys("lost/")
        return {k[len("lost/"):] for k, raw in zip(keys, self.store.multi_get(keys)) if self.verified(k, raw)}

    def _dead(self, node_ids: list[str], now: float, lost: set[str] | None = None) -> frozenset[str]:
        if not node_ids:
            return frozenset()
        for node_id, value in read_counters(self.store, node_ids, self.left_check).items():
            self.tracker.observe(node_id, value, now)
        lost = self._lost() if lost is None else lost
        return frozenset(n for n in node_ids if n in lost or self.tracker.is_dead(n, now))

    def _wait_for(self, keys: list[str], timeout: float, also: str | None = None) -> None:
        """Block until ``keys`` exist or ``timeout``; ``also`` is checked first (one more key
        that ends the wait, e.g. the round's result, which the store cannot wait on with "any")."""
        if also is not None and self.store.try_get(also) is not None:
            return
        try:
            self.store.wait(keys, max(timeout, 0.001))
        except StoreTimeout:
            pass

    def _read_result(self, n: int) -> RoundResult | None:
        raw = self.store.try_get(round_key(n, "result"))
        return None if raw is None else decode_result(self._k(round_key(n, "result")), raw, self.signer)

    def _raise_if_shut_down(self) -> None:
        raw = self.store.try_get("shutdown")
        if self.verified("shutdown", raw):
            assert raw is not None
            reason = decode_note(self._k("shutdown"), raw).get("reason", "finished")
            raise RendezvousClosed(f"job {self.config.job_id!r} has finished ({reason}); nothing to join")

    # -- while running ----------------------------------------------------------------------
    def num_nodes_waiting(self) -> int:
        """Nodes that have arrived for the round after ours: a reason to re-rendezvous."""
        n = self.current.round if self.current else self.store.add("latest", 0)
        return self.store.add(round_key(n + 1, "arrivals"), 0)

    def mark_lost(self, node_id: str, reason: str) -> None:
        """Publish that ``node_id`` is gone, so the next round's closer need not wait for it."""
        self.store.compare_set(f"lost/{node_id}", None, self.note(f"lost/{node_id}", by=self.node_id, reason=reason))

    def note(self, key: str, **body: Any) -> bytes:
        """A JSON note for ``key``, signed when the job has a token."""
        return encode_note(self.signer, self._k(key), **body)

    def shutdown(self, reason: str = "finished") -> None:
        """Close the job: every node waiting now or arriving later gets :class:`RendezvousClosed`."""
        self.store.compare_set("shutdown", None, self.note("shutdown", reason=reason, by=self.node_id))
        latest = self.store.add("latest", 0)
        for n in (latest, latest + 1):
            if n > 0:
                key = round_key(n, "result")
                self.store.compare_set(key, None, RoundResult(n, shutdown=reason).to_json(self.signer, self._k(key)))

    def close(self, leaving: bool = True) -> None:
        """Stop heartbeating; ``leaving`` tells peers at once instead of after the timeout."""
        if self._heartbeat is not None:
            self._heartbeat.stop(leaving=leaving)
            self._heartbeat = None

    def heartbeat_silence(self) -> float:
        """Seconds since this node's heartbeat last reached the store (0 when not beating)."""
        hb = self._heartbeat
        return 0.0 if hb is None else hb.silent_for()

    @property
    def heartbeat_error(self) -> str | None:
        hb = self._heartbeat
        return None if hb is None or hb.last_error is None else str(hb.last_error)


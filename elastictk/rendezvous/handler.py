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
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ..store import PrefixStore, Store, StoreTimeout
from ..store.base import Backoff
from .auth import ALG, Signer
from .config import RendezvousConfig
from .decide import Arrival, Close, Fail, Hold, RoundView, Wait, decide, round_to_join
from .errors import (
    RendezvousAuthError, RendezvousClosed, RendezvousInterrupted, RendezvousStateError, RendezvousTimeout,
)
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
from .sealed import Records, new_run_nonce, parse_counter
from .waiting import WaitingReporter, waiting_line

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


_ROUNDS_CAP = 2**53  # no job runs more rounds; a counter past it is garbage, clamped

# The longest a waiting node takes to notice ``interrupt()`` (each wait is sliced to it).
INTERRUPT_LATENCY = 0.5

def closed(job_id: str, reason: str) -> RendezvousClosed:
    """What a node is told when the job ended before it could join: ``reason`` says how
    (``shutdown``): ``failed: ...`` when the job gave up, anything else when it finished."""
    if not reason.startswith("failed"):
        return RendezvousClosed(f"job {job_id!r} has finished ({reason}); nothing to join")
    return RendezvousClosed(f"job {job_id!r} has ended ({reason}); nothing to join", succeeded=False)


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
        self._interrupted = threading.Event()
        self._heartbeat: Heartbeat | None = None
        self.tracker = LivenessTracker(config.heartbeat_timeout)
        self.current: RoundInfo | None = None
        self.signer = Signer(config.token, config.job_id)  # bound to the run once admitted
        self.records = Records(self.store, self.prefix, self.signer)
        self._admitted = False
        self._ignored: set[str] = set()
        self._deadline = 0.0  # of the join in progress; a spare's is pushed on while it waits
        #: Called with (round, members of the full round before it) when this node waits as a
        #: spare for that round (the agent emits ``spare_waiting``); never raises into the join.
        self.on_spare: Callable[[int, int], None] | None = None

    @property
    def arrival_cap(self) -> int:
        """The most arrivals of one round this node reads: the counter is writable by anyone,
        so it never sizes a read beyond this (nodes past it wait for the next round)."""
        return 2 * self.config.max_nodes + 32

    def _k(self, key: str) -> str:
        """The full store key (what a record's MAC covers and what errors name)."""
        return f"{self.prefix}/{key}"

    def _ignore(self, key: str, why: str) -> None:
        if key not in self._ignored:
            self._ignored.add(key)
            log.warning("ignored store key %r: %s", self._k(key), why)

    def _admit(self) -> None:
        """Stamp the job with our token mode and a fresh run nonce, or check that we may join
        the job stamped so; from then on every record is sealed for that run."""
        if self._admitted:
            return
        base = Signer(self.config.token, self.config.job_id)  # the auth record: run ""
        mine = encode_note(base, self._k("auth"), auth=ALG if base.enabled else "none", run=new_run_nonce())
        raw = self.store.compare_set("auth", None, mine) or mine
        stamp = decode_note(self._k("auth"), raw)
        base.admit(self._k("auth"), stamp, self.config.job_id, self.node_id)
        run = stamp.get("run")
        self.signer = base.for_run(run if isinstance(run, str) else "")
        self.records = Records(self.store, self.prefix, self.signer)
        self._admitted = True

    @property
    def run_nonce(self) -> str:
        """The run's identity (from the job's ``auth`` record); "" before this node joined."""
        return self.signer.run

    @property
    def left_check(self) -> Callable[[str, bytes | None], bool] | None:
        """How a LEFT heartbeat mark is checked: None without a token (believed as is)."""
        return self.verified if self.signer.enabled else None

    def verified(self, key: str, raw: bytes | None) -> bool:
        """Whether the note at ``key`` (``lost/..``, ``shutdown``, a slot) is a record of this
        run; a forged, replayed or garbled one is ignored with a warning naming the key, never
        believed (and never raises: watch threads call this)."""
        if raw is None:
            return False
        try:
            decode_note(self._k(key), raw, self.signer)
            return True
        except RendezvousStateError as e:
            self._ignore(key, str(e))
            return False

    def _decode_result(self, key: str, raw: bytes | None) -> RoundResult | None:
        """A round's result; None when absent or, with a token, when it does not verify
        (a stranger's result is absent: the closer's compare-and-set replaces it)."""
        if raw is None:
            return None
        try:
            return decode_result(self._k(key), raw, self.signer)
        except RendezvousAuthError as e:
            self._ignore(key, str(e))
            return None
        except RendezvousStateError as e:
            if not self.signer.enabled:
                raise  # no token: garbage is an error naming the key, as before
            self._ignore(key, str(e))
            return None

    # -- joining ----------------------------------------------------------------------------
    def interrupt(self) -> None:
        """Make a ``next_round`` in progress (or the next one) raise :class:`RendezvousInterrupted`
        within ``INTERRUPT_LATENCY``: a SIGTERM must not wait out the join timeout. Safe from a
        signal handler (it sets an event)."""
        self._interrupted.set()

    def _check_interrupted(self) -> None:
        if self._interrupted.is_set():
            raise RendezvousInterrupted(f"node {self.node_id} stopped waiting for a round of job "
                                        f"{self.config.job_id!r}: interrupted")

    def next_round(self) -> RoundInfo:
        """Join the next round and block until it closes; this node's rank and the membership.

        Raises :class:`RendezvousClosed` when the job has finished, :class:`RendezvousTimeout`
        when too few nodes came within the join timeout.
        """
        cfg = self.config
        self._deadline = self._clock() + cfg.join_timeout
        self._admit()
        self.start_heartbeat()
        floor = 1
        while True:
            self._check_interrupted()
            self._raise_if_shut_down()
            if self._clock() >= self._deadline:
                raise RendezvousTimeout(
                    f"node {self.node_id} found no round of job {cfg.job_id!r} with room for it "
                    f"within the join timeout of {cfg.join_timeout:g}s (all closed at --nnodes MAX?)"
                )
            n = self._open_round(floor)
            seq = self.store.add(round_key(n, "arrivals"), 1)
            slot = slot_key(n, seq)
            self.store.set(slot, NodeRecord(self.node_id, self.meta).to_json(self.signer, self._k(slot)))
            self._say_if_spare(n)
            result = self._await(n, seq)
            if result.shutdown is not None:
                raise closed(cfg.job_id, result.shutdown)
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

    def _spare_for(self, n: int) -> RoundResult | None:
        """The full round before ``n`` when this node is not one of its members (it waits as a
        spare for ``n`` until a member is lost or leaves); else None."""
        previous = self._read_result(n - 1) if n > 1 else None
        if (previous is None or previous.shutdown is not None or len(previous.members) < self.config.max_nodes
                or previous.rank_of(self.node_id) is not None):
            return None
        return previous

    def _say_if_spare(self, n: int) -> None:
        previous = self._spare_for(n)
        if previous is None:
            return
        log.info("node %s waits as a spare: round %d runs full (%d of --nnodes MAX %d); it joins round %d "
                 "when a member is lost or leaves", self.node_id, n - 1, len(previous.members),
                 self.config.max_nodes, n)
        if self.on_spare is not None:
            try:
                self.on_spare(n, len(previous.members))
            except Exception as e:  # noqa: BLE001 - a report, never a reason to fail the join
                log.warning("spare callback failed: %r", e)

    def start_heartbeat(self) -> None:
        """Start heartbeating now instead of in the first :meth:`next_round`.

        The heartbeat has a store connection of its own. Opening one costs a few round trips,
        and a c10d client also looks up its socket's host name, a DNS query that a slow
        resolver stretches to seconds; an agent that calls this while it prepares its workers
        keeps all that off the rendezvous' critical path. Idempotent; :meth:`close` stops it.
        """
        if self._heartbeat is None:
            # The left note is sealed when the node leaves: by then it knows the run's nonce.
            left = (lambda: self.note(f"left/{self.node_id}", node_id=self.node_id)) if self.signer.enabled else None
            self._heartbeat = Heartbeat(self.store, self.node_id, self.config.heartbeat_interval, left_note=left)

    def _open_round(self, floor: int) -> int:
        """The round to join; never below ``floor`` (a round that already closed without us)."""
        raw = self.store.try_get("latest")  # a read: joiners never race to write it
        latest = parse_counter(raw, _ROUNDS_CAP)
        closed = latest > 0 and self._read_result(latest) is not None
        n = max(round_to_join(latest, closed), floor)
        if n > latest:  # one try: whoever loses saw a newer round opened by another node
            self.store.compare_set("latest", raw, str(n).encode())
        return n

    def _await(self, n: int, seq: int) -> RoundResult:
        """Wait for round ``n``'s result; close it ourselves when we are the closer."""
        cfg = self.config
        result_key = round_key(n, "result")
        previous = self._read_result(n - 1) if n > 1 else None
        spare = self._spare_for(n) is not None
        records: dict[int, Arrival | None] = {}
        opened_at, min_reached_at = self._clock(), None
        reporter, holding = WaitingReporter(opened_at), False
        while True:
            deadline = self._deadline
            self._check_interrupted()
            raw = self.store.try_get(result_key)
            result = self._decode_result(result_key, raw)
            if result is not None:
                return result
            now = self._clock()
            if not (spare or holding) and reporter.due(now):
                self._say_waiting(n, deadline - now)
            if self._closer_alive_before(n, seq, records, now):
                if spare:  # behind an earlier spare, which holds the round while the job runs full
                    self._deadline = deadline = max(deadline, now + cfg.join_timeout)
                elif now >= deadline:
                    raise RendezvousTimeout(
                        f"round {n} of job {cfg.job_id!r} did not form within the join timeout of "
                        f"{cfg.join_timeout:g}s; start more nodes or lower --nnodes MIN"
                    )
                if raw is None:
                    self._wait_for([result_key], min(self._slice, deadline - now))
                else:  # bytes that are not the result: the store cannot wait for a change
                    time.sleep(max(0.001, min(self._slice, deadline - now)))
                continue
            # We close this round.
            count = parse_counter(self.store.try_get(round_key(n, "arrivals")), self.arrival_cap)
            arrivals = self._read_slots(n, records, 1, count)
            watch = [a.node_id for a in arrivals]
            if previous is not None:
                watch += [m.node_id for m in previous.members]
            dead = self._dead(sorted(set(watch) - {self.node_id}), now)
            view = RoundView(n, tuple(arrivals), previous, dead, now, opened_at, min_reached_at)
            decision = decide(view, cfg)
            if isinstance(decision, Close):
                mine = RoundResult(n, decision.members).to_json(self.signer, self._k(result_key))
                won = self._decode_result(result_key, self.store.compare_set(result_key, raw, mine))
                if won is not None:
                    return won
                continue  # someone replaced what we saw meanwhile: look again
            if isinstance(decision, Fail):
                raise RendezvousTimeout(decision.reason)
            if isinstance(decision, Hold):
                # Spares wait as long as the job runs full; the round's clocks (join timeout,
                # last call, the wait for previous members) start when the hold ends.
                opened_at, min_reached_at, holding = now, None, True
                self._deadline = max(deadline, now + cfg.join_timeout)
                self._wait_for([slot_key(n, decision.wake_seq)], self._slice, also=result_key)
                continue
            assert isinstance(decision, Wait)
            min_reached_at = decision.min_reached_at
            until = min(decision.until, now + self._slice)
            # A node bumps the counter before it writes its slot. ``wake_seq`` counts on from
            # the highest written slot, so while a lower one is still unwritten it lies past
            # the last node to come; wait for that slot first, then decide again.
            hole = next((s for s in range(1, count + 1) if s not in records), None)
            wake = decision.wake_seq if hole is None else hole
            self._wait_for([slot_key(n, wake)], until - now, also=result_key)

    def _say_waiting(self, n: int, left: float) -> None:
        """The waiting line for round ``n``: one read of its arrival counter (capped as every
        read of it is), logged at INFO."""
        cfg = self.config
        joined = parse_counter(self.store.try_get(round_key(n, "arrivals")), self.arrival_cap)
        log.info("%s", waiting_line(n, joined, cfg.min_nodes, cfg.max_nodes, left, cfg.last_call,
                                    cfg.job_id))

    def _closer_alive_before(self, n: int, seq: int, cache: dict[int, Arrival | None], now: float) -> bool:
        """Whether an earlier arrival than us is alive to close the round.

        Slots are read from the first on, in batches of 1, 2, 4, ... and only until a live
        one turns up, and only that node's ``lost/`` key is read: normally slot 1 holds the
        live closer, so a waiting node costs the store O(1) small reads per heartbeat, not
        a read of every earlier slot and a listing of every key.
        """
        if seq > self.arrival_cap:
            return True  # past what any node reads (a flood of arrivals): never the closer
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
                    except RendezvousStateError as e:  # a stranger's join: never counted
                        if not self.signer.enabled and not isinstance(e, RendezvousAuthError):
                            raise  # no token: garbage is an error naming the key, as before
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

    @property
    def _slice(self) -> float:
        """The longest single wait: a heartbeat interval, and short enough for ``interrupt``."""
        return min(self.config.heartbeat_interval, INTERRUPT_LATENCY)

    def _wait_for(self, keys: list[str], timeout: float, also: str | None = None) -> None:
        """Block until ``keys`` exist or ``timeout``; ``also`` is checked first (one more key
        that ends the wait, e.g. the round's result, which the store cannot wait on with "any")."""
        if also is not None and self._decode_result(also, self.store.try_get(also)) is not None:
            return
        try:
            self.store.wait(keys, max(timeout, 0.001))
        except StoreTimeout:
            pass

    def _read_result(self, n: int) -> RoundResult | None:
        return self._decode_result(round_key(n, "result"), self.store.try_get(round_key(n, "result")))

    def _raise_if_shut_down(self) -> None:
        raw = self.store.try_get("shutdown")
        if self.verified("shutdown", raw):
            assert raw is not None
            reason = str(decode_note(self._k("shutdown"), raw).get("reason", "finished"))[:200]
            raise closed(self.config.job_id, reason)

    # -- while running ----------------------------------------------------------------------
    def num_nodes_waiting(self) -> int:
        """Nodes that have arrived for the round after ours: a reason to re-rendezvous."""
        n = self.current.round if self.current else self.store.add("latest", 0)
        return parse_counter(self.store.try_get(round_key(n + 1, "arrivals")), self.config.max_nodes)

    def mark_lost(self, node_id: str, reason: str) -> None:
        """Publish that ``node_id`` is gone, so the next round's closer need not wait for it."""
        self.claim_note(f"lost/{node_id}", self.note(f"lost/{node_id}", by=self.node_id, reason=reason))

    def claim_note(self, key: str, mine: bytes, store: Store | None = None,
                   believed: Callable[[str, bytes | None], bool] | None = None) -> None:
        """Compare-and-set a note into ``key`` unless one of this run is there; bytes that do
        not verify (a stranger's, another run's) count as absent and are replaced."""
        store = store or self.store
        believed = believed or self.verified
        pause = Backoff()
        for _ in range(100):
            raw = store.try_get(key)
            if raw is not None and believed(key, raw):
                return
            if store.compare_set(key, raw, mine) == mine:
                return
            pause.sleep()  # another writer won this try: let the racers spread out

    def note(self, key: str, **body: Any) -> bytes:
        """A JSON note for ``key``, signed when the job has a token."""
        return encode_note(self.signer, self._k(key), **body)

    def shutdown(self, reason: str = "finished") -> None:
        """Close the job: every node waiting now or arriving later gets :class:`RendezvousClosed`."""
        self.claim_note("shutdown", self.note("shutdown", reason=reason, by=self.node_id))
        latest = self.store.add("latest", 0)
        for n in (latest, latest + 1):
            if n > 0:
                key = round_key(n, "result")
                self.claim_note(key, RoundResult(n, shutdown=reason).to_json(self.signer, self._k(key)),
                                believed=self._result_believed)

    def _result_believed(self, key: str, raw: bytes | None) -> bool:
        try:
            return self._decode_result(key, raw) is not None
        except RendezvousStateError:
            return False

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


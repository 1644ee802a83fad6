"""The rendezvous handler an agent calls to join a job: ``next_round()`` and friends.

A join costs each node a constant number of store calls and bytes, whatever the round's size:
one read (``latest``, the shutdown note, a round's size record), an arrival-counter bump, its
own slot, then a blocking wait on its own assignment key (rank, world size, rank 0's meta,
ring successors), woken once when the closer writes it, and one read of it. It never reads
the member list (``RoundInfo.members`` does, on first use). One node, the earliest live
arrival, closes the round (:mod:`elastictk.rendezvous.closing`): it alone reads the O(N)
slots once, writes the result with one compare-and-set and every assignment in bulk; if it
dies, the next earliest takes over. The decisions live in :mod:`elastictk.rendezvous.decide`.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ..lifetime.sigflag import SignalFlag
from ..store import PrefixStore, Store, StoreError, StoreTimeout
from ..store.base import Backoff
from .auth import ALG, Signer
from .closing import _UNREAD, RoundCloser, closed
from .config import RendezvousConfig
from .decide import Arrival, round_to_join
from .errors import (
    RendezvousAuthError, RendezvousInterrupted, RendezvousStateError, RendezvousTimeout,
)
from .leased import LeasedJoin, LeaseBox
from .lostlog import LostReader, log_lost
from .liveness import Heartbeat, LivenessTracker, await_departures
from .records import (
    Assignment,
    Member,
    NodeRecord,
    RoundResult,
    RoundSize,
    decode_note,
    decode_ranks,
    decode_result,
    encode_note,
    round_key,
    size_key,
    slot_key,
    to_key,
)
from .sealed import Records, new_run_nonce, parse_counter
from .roundinfo import RoundInfo, default_node_id  # noqa: F401 - re-exported: where callers import them
from .waiting import WaitingReporter, waiting_line

log = logging.getLogger("elastictk.rendezvous")


_ROUNDS_CAP = 2**53  # no job runs more rounds; a counter past it is garbage, clamped

# The longest a waiting node takes to notice ``interrupt()`` (each wait is sliced to it).
INTERRUPT_LATENCY = 0.5

class RendezvousHandler(LeasedJoin, RoundCloser):
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
        self._interrupted = SignalFlag()  # raised from the agent's signal handler
        self._heartbeat: Heartbeat | None = None
        self._lease: LeaseBox | None = None  # on a store with ordered arrivals (etcd)
        self._arrival_cursor: dict[int, int] = {}
        self._lost_log = LostReader()  # the closer's place in the log of lost nodes
        self.tracker = LivenessTracker(config.heartbeat_timeout)
        self.current: RoundInfo | None = None
        self.signer = Signer(config.token, config.job_id)  # bound to the run once admitted
        self.records = Records(self.store, self.prefix, self.signer)
        self._admitted = False
        self._ignored: set[str] = set()
        self._sizes: dict[int, RoundSize] = {}  # closed rounds' size records (they never change)
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
        signal handler (it raises a lock-free flag)."""
        self._interrupted.set()

    def _member_of(self) -> int | None:
        """The round this node ran in (its arrival says so: a running round's watchers re-form
        on a member's return without reading the member list)."""
        return self.current.round if self.current is not None else None

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
        self.start_heartbeat()  # and, before it, this process's admission to the job
        floor = 1
        while True:
            self._check_interrupted()
            if self._clock() >= self._deadline:
                raise RendezvousTimeout(
                    f"node {self.node_id} found no round of job {cfg.job_id!r} with room for it "
                    f"within the join timeout of {cfg.join_timeout:g}s (all closed at --nnodes MAX?)"
                )
            n = self._open_round(floor)
            if self._lease is not None:  # etcd: one key under our lease, no counter
                mine = self._join_leased(n)
            else:
                seq = self.store.add(round_key(n, "arrivals"), 1)
                slot = slot_key(n, seq)
                self.store.set(slot, NodeRecord(self.node_id, self.meta, self._member_of()).to_json(
                    self.signer, self._k(slot)))
                self._say_if_spare(n)
                mine = self._await(n, seq)
            if mine is not None:
                self.current = RoundInfo(
                    n, mine.rank, mine.world, f"{self.prefix}/{round_key(n, 'job')}",
                    PrefixStore(round_key(n, "job"), self.store), mine.master, mine.ring,
                    ranks=decode_ranks(mine.extra),
                    load_members=lambda n=n: self._members_of(n),  # type: ignore[misc]
                )
                return self.current
            # The round closed without us (we came after the closer counted, or past max):
            # we are now waiting for the next round, which num_nodes_waiting() reports.
            floor = n + 1

    def _members_of(self, n: int) -> tuple[Member, ...]:
        """Round ``n``'s member list (its result: O(N) bytes), for those that ask for it."""
        result = self._read_result(n)
        if result is None or result.shutdown is not None:
            raise RendezvousStateError(f"round {n} of job {self.config.job_id!r} has no member list in the store")
        return result.members

    def start_heartbeat(self) -> None:
        """Start heartbeating now instead of in the first :meth:`next_round`.

        The heartbeat has a store connection of its own. Opening one costs a few round trips,
        and a c10d client also looks up its socket's host name, a DNS query that a slow
        resolver stretches to seconds; an agent that calls this while it prepares its workers
        keeps all that off the rendezvous' critical path. Idempotent; :meth:`close` stops it.
        """
        self._admit()  # once per process: off the join's critical path when called early
        if self._lease is None and self.store.ordered_arrivals:
            self._lease = LeaseBox(self.store, self.config.heartbeat_timeout)
        if self._heartbeat is None:
            # The left note is sealed when the node leaves: by then it knows the run's nonce.
            left = (lambda: self.note(f"left/{self.node_id}", node_id=self.node_id)) if self.signer.enabled else None
            self._heartbeat = Heartbeat(self.store, self.node_id, self.config.heartbeat_interval, left_note=left,
                                        lease=self._lease)

    def _open_round(self, floor: int) -> int:
        """The round to join; never below ``floor`` (a round that already closed without us).

        ``latest`` is the open round, written only by the closer of the round before it (with
        the assignments), so joiners never race to write it. One read here: ``latest``, the
        shutdown note and the size record of the round this node expects to be open (its
        last round's next, or 1), which says whether that one closed meanwhile."""
        guess = self.current.round + 1 if self.current is not None else 1
        raw, shut, size_raw = self.store.multi_get(["latest", "shutdown", size_key(guess)])
        if self.verified("shutdown", shut):
            assert shut is not None
            reason = str(decode_note(self._k("shutdown"), shut).get("reason", "finished"))[:200]
            raise closed(self.config.job_id, reason)
        latest = max(parse_counter(raw, _ROUNDS_CAP), 1)
        closed_ = self._size(latest, size_raw if latest == guess else _UNREAD) is not None
        return max(round_to_join(latest, closed_), floor)

    def _await(self, n: int, seq: int) -> Assignment | None:
        """Wait for this node's assignment in round ``n`` (None: the round closed without it);
        close the round ourselves when we are the closer.

        A waiting node blocks on its own assignment key, woken once when the closer writes it;
        each slice it waits (short enough for :meth:`interrupt`) ends with one read of that
        key, the round's size record and the shutdown note, and, every heartbeat interval,
        a look at whether the earlier arrival that closes the round is still alive."""
        cfg = self.config
        mine = to_key(n, self.node_id)
        spare = self._spare_for(n) is not None
        records: dict[int, Arrival | None] = {}
        opened_at = self._clock()
        reporter = WaitingReporter(opened_at)
        checked_at = opened_at  # the closer's liveness: first looked at after a heartbeat interval
        while seq > 1:
            self._check_interrupted()
            deadline = self._deadline
            now = self._clock()
            try:
                self.store.wait([mine], max(0.001, min(self._slice, deadline - now)))
            except StoreTimeout:
                pass
            raw, size_raw, shut = self.store.multi_get([mine, size_key(n), "shutdown"])
            got = self._decode_assignment(mine, raw)
            if got is not None:
                return got
            if self.verified("shutdown", shut):
                self._raise_if_shut_down()
            if self._size(n, size_raw) is not None:
                return None  # closed without us: the next round
            if raw is not None:  # bytes that do not verify: the store cannot wait for a change
                time.sleep(max(0.001, min(self._slice, deadline - self._clock())))
            now = self._clock()
            if not spare and reporter.due(now):
                self._say_waiting(n, deadline - now)
            if now - checked_at < cfg.heartbeat_interval:
                continue
            checked_at = now
            if not self._closer_alive_before(n, seq, records, now):
                break  # we close this round
            if spare:  # behind an earlier spare, which holds the round while the job runs full
                self._deadline = max(deadline, now + cfg.join_timeout)
            elif now >= deadline:
                raise RendezvousTimeout(
                    f"round {n} of job {cfg.job_id!r} did not form within the join timeout of "
                    f"{cfg.join_timeout:g}s; start more nodes or lower --nnodes MIN"
                )
        return self._close(n, records, opened_at)

    def _say_waiting(self, n: int, left: float) -> None:
        """The waiting line for round ``n``: one read of its arrival counter (capped as every
        read of it is), logged at INFO."""
        cfg = self.config
        joined = self._arrived(n)
        log.info("%s", waiting_line(n, joined, cfg.min_nodes, cfg.max_nodes, left, cfg.last_call,
                                    cfg.job_id))

    def _arrived(self, n: int) -> int:
        """How many nodes arrived for round ``n`` (one read; capped as every read of it is)."""
        if self._lease is not None or self.store.ordered_arrivals:
            return min(self.store.count(round_key(n, "a") + "/"), self.arrival_cap)
        return parse_counter(self.store.try_get(round_key(n, "arrivals")), self.arrival_cap)

    @property
    def _slice(self) -> float:
        """The longest single wait: a heartbeat interval, and short enough for ``interrupt``."""
        return min(self.config.heartbeat_interval, INTERRUPT_LATENCY)

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
        n = self.current.round if self.current else max(self.store.add("latest", 0), 1) - 1  # latest: the open one
        return min(self._arrived(n + 1), self.config.max_nodes)

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
                if key.startswith("lost/"):  # the closers read the log, never list every note
                    log_lost(store, key[len("lost/"):])
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
                if self.store.ordered_arrivals:  # nodes waiting there wait on their own key
                    self._tell_shutdown(n, reason)

    def await_departures(self, node_ids: list[str], timeout: float) -> list[str]:
        """Until every node of ``node_ids`` has left or fallen silent for ``heartbeat_timeout``,
        at most ``timeout`` seconds (an interrupt ends it); returns those still beating.

        The node hosting a c10d store takes the store with it when it exits: after it closed
        the job (a flag that differs between nodes, its workers out of restarts), a peer that
        has not yet read why would find the store gone and end with "store lost" instead of
        the job's own line. So the host waits for them to leave first."""
        return await_departures(self.store, node_ids, timeout, self.config.heartbeat_timeout,
                                self.left_check, self._interrupted.wait)

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
        lease, self._lease = self._lease, None
        if lease is not None and leaving:  # our arrival keys go with it at once
            try:
                self.store.revoke(lease.id)
            except StoreError:
                pass

    def heartbeat_silence(self) -> float:
        """Seconds since this node's heartbeat last reached the store (0 when not beating)."""
        hb = self._heartbeat
        return 0.0 if hb is None else hb.silent_for()

    def heartbeat_unscheduled(self) -> float:
        """Seconds since the heartbeat thread last woke to beat (long on a CPU-starved host)."""
        hb = self._heartbeat
        return 0.0 if hb is None else hb.unscheduled_for()

    @property
    def heartbeat_error(self) -> str | None:
        hb = self._heartbeat
        return None if hb is None or hb.last_error is None else str(hb.last_error)


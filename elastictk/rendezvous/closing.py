"""Closing a round: what only the closer does, and the few records a joiner reads instead.

The closer (the earliest live arrival) alone reads the slots, the heartbeats and the previous
round's member list, decides (:mod:`elastictk.rendezvous.decide`), writes the result with one
compare-and-set and then every member's assignment, the round's size record and the next
round's number in one bulk write (``Store.multi_set``). A closer that dies between its result
and that write is replaced by the next earliest arrival, which finds the result and publishes
it. Joiners read only their own assignment and the small size records (:meth:`_size`).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from ..store import StoreTimeout
from .decide import Arrival, Close, Fail, Hold, RoundView, Wait, decide
from .errors import RendezvousAuthError, RendezvousClosed, RendezvousStateError, RendezvousTimeout
from .liveness import read_counters
from .records import (
    Assignment, RoundResult, RoundSize, assignments, decode_assignment, decode_node, decode_size, round_key,
    size_key, slot_key, to_key,
)
from .sealed import parse_counter
from .waiting import WaitingReporter

if TYPE_CHECKING:
    from ..store import Store
    from .auth import Signer
    from .config import RendezvousConfig
    from .liveness import LivenessTracker
    from .lostlog import LostReader

log = logging.getLogger("elastictk.rendezvous")
_UNREAD = object()  # a record not read yet (None: read, and absent)


def closed(job_id: str, reason: str) -> RendezvousClosed:
    """What a node is told when the job ended before it could join: ``reason`` says how
    (``shutdown``): ``failed: ...`` when the job gave up, anything else when it finished."""
    if not reason.startswith("failed"):
        return RendezvousClosed(f"job {job_id!r} has finished ({reason}); nothing to join")
    return RendezvousClosed(f"job {job_id!r} has ended ({reason}); nothing to join", succeeded=False)


class RoundCloser:
    """The closer's part of :class:`~elastictk.rendezvous.handler.RendezvousHandler` (a mixin)."""

    if TYPE_CHECKING:  # what the handler provides
        store: Store
        signer: Signer
        node_id: str
        config: RendezvousConfig
        tracker: LivenessTracker
        on_spare: Callable[[int, int], None] | None
        current: Any  # RoundInfo | None (handler.py, which imports this module)
        _sizes: dict[int, RoundSize]
        _lost_log: LostReader
        _deadline: float
        _clock: Callable[[], float]

        @property
        def arrival_cap(self) -> int: ...
        @property
        def _slice(self) -> float: ...
        @property
        def left_check(self) -> Callable[[str, bytes | None], bool] | None: ...

        def _k(self, key: str) -> str: ...
        def _ignore(self, key: str, why: str) -> None: ...
        def _decode_result(self, key: str, raw: bytes | None) -> RoundResult | None: ...
        def verified(self, key: str, raw: bytes | None) -> bool: ...
        def _say_waiting(self, n: int, left: float) -> None: ...
        def _read_result(self, n: int) -> RoundResult | None: ...
        def _check_interrupted(self) -> None: ...
        def _read_arrivals(self, n: int, cache: dict[int, Arrival | None]) -> int: ...
        def _wait_arrivals(self, n: int, have: int, want: int, timeout: float) -> None: ...
        def _left_out(self, n: int, members: set[str],
                      cache: dict[int, Arrival | None]) -> list[tuple[str, bytes]]: ...

    def _size(self, n: int, raw: bytes | None | object = _UNREAD) -> RoundSize | None:
        """Round ``n``'s size record (it closed, with how many); None while it is open. Read
        once (``raw`` when the caller read it already) and kept: a closed round never changes."""
        if n in self._sizes:
            return self._sizes[n]
        key = size_key(n)
        raw = self.store.try_get(key) if raw is _UNREAD else raw
        try:
            size = decode_size(self._k(key), raw, self.signer) if isinstance(raw, bytes) else None
        except RendezvousStateError as e:  # a stranger's, or garbage: absent, never a crash
            self._ignore(key, str(e))
            size = None
        if size is not None:
            self._sizes[n] = size
        return size

    def _spare_for(self, n: int) -> RoundSize | None:
        """The size record of the full round before ``n`` when this node is not one of its
        members (it waits as a spare for ``n`` until a member is lost or leaves); else None.
        A member of round n-1 knows it without a read; others read one small record."""
        if n <= 1 or (self.current is not None and self.current.round == n - 1):
            return None
        previous = self._size(n - 1)
        if previous is None or previous.world < self.config.max_nodes:
            return None
        return previous

    def _say_if_spare(self, n: int) -> None:
        previous = self._spare_for(n)
        if previous is None:
            return
        log.info("node %s waits as a spare: round %d runs full (%d of --nnodes MAX %d); it joins round %d "
                 "when a member is lost or leaves", self.node_id, n - 1, previous.world,
                 self.config.max_nodes, n)
        if self.on_spare is not None:
            try:
                self.on_spare(n, previous.world)
            except Exception as e:  # noqa: BLE001 - a report, never a reason to fail the join
                log.warning("spare callback failed: %r", e)

    def _close(self, n: int, records: dict[int, Arrival | None], opened_at: float) -> Assignment | None:
        """This node closes round ``n``: it alone reads the slots, the heartbeats and the
        previous round's member list (once), decides, writes the result with one
        compare-and-set and then every member's assignment in bulk."""
        cfg = self.config
        result_key = round_key(n, "result")
        previous = self._read_result(n - 1) if n > 1 else None
        min_reached_at, holding = None, False
        reporter = WaitingReporter(opened_at)
        while True:
            deadline = self._deadline
            self._check_interrupted()
            raw = self.store.try_get(result_key)
            result = self._decode_result(result_key, raw)
            if result is not None:
                return self._publish(result, records)
            now = self._clock()
            if not holding and reporter.due(now):
                self._say_waiting(n, deadline - now)
            if self.store.ordered_arrivals:  # etcd: arrivals in creation order, each read once
                count = self._read_arrivals(n, records)
                arrivals = [a for a in records.values() if a is not None]
            else:
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
                    return self._publish(won, records)
                continue  # someone replaced what we saw meanwhile: look again
            if isinstance(decision, Fail):
                raise RendezvousTimeout(decision.reason)
            if isinstance(decision, Hold):
                # Spares wait as long as the job runs full; the round's clocks (join timeout,
                # last call, the wait for previous members) start when the hold ends.
                opened_at, min_reached_at, holding = now, None, True
                self._deadline = max(deadline, now + cfg.join_timeout)
                self._wait_next(n, count, decision.wake_seq, self._slice, result_key)
                continue
            assert isinstance(decision, Wait)
            min_reached_at = decision.min_reached_at
            until = min(decision.until, now + self._slice)
            # A node bumps the counter before it writes its slot. ``wake_seq`` counts on from
            # the highest written slot, so while a lower one is still unwritten it lies past
            # the last node to come; wait for that slot first, then decide again.
            hole = next((s for s in range(1, count + 1) if s not in records), None)
            wake = decision.wake_seq if hole is None else hole
            self._wait_next(n, count, wake, until - now, result_key)

    def _wait_next(self, n: int, count: int, wake_seq: int, timeout: float, also: str) -> None:
        """Wait until arrival ``wake_seq`` of round ``n`` came (``count`` are read), ``also``
        (the result) exists, or ``timeout``."""
        if not self.store.ordered_arrivals:
            self._wait_for([slot_key(n, wake_seq)], timeout, also=also)
        elif self._decode_result(also, self.store.try_get(also)) is None:
            self._wait_arrivals(n, count, wake_seq, timeout)

    def _publish(self, result: RoundResult, records: dict[int, Arrival | None] | None = None) -> Assignment | None:
        """Write every member's assignment and the round's size record (one bulk write), unless
        the size record says another closer did; this node's own assignment (None: not in it).
        A closer that died between its result and this is replaced by the next closer, which
        finds the result and publishes it."""
        if result.shutdown is not None:
            raise closed(self.config.job_id, result.shutdown)
        n = result.round
        everyone = assignments(result)
        if self._size(n) is None:
            items = [(to_key(n, node), a.to_json(self.signer, self._k(to_key(n, node))))
                     for node, a in everyone.items()]
            size = RoundSize(n, len(result.members))
            items.append((size_key(n), size.to_json(self.signer, self._k(size_key(n)))))
            items.append(("latest", str(n + 1).encode()))  # the round joiners open next
            if self.store.ordered_arrivals:  # arrivals left out are told so (they wait on their key)
                items[:0] = self._left_out(n, set(everyone), {} if records is None else records)
            self.store.multi_set(items)
            self._sizes[n] = size
        return everyone.get(self.node_id)

    def _decode_assignment(self, key: str, raw: bytes | None) -> Assignment | None:
        if raw is None:
            return None
        try:
            return decode_assignment(self._k(key), raw, self.signer)
        except RendezvousStateError as e:  # a stranger's, or garbage: absent, never a crash
            self._ignore(key, str(e))
            return None

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
        """Nodes marked lost: one read of the log's counter and only the entries added since
        the last decision (:mod:`elastictk.rendezvous.lostlog`), never a listing of ``lost/``."""
        return self._lost_log.read(self.store, self.verified)

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
        if also is not None and self._decode_result(also, self.store.try_get(also)) is not None:
            return
        try:
            self.store.wait(keys, max(timeout, 0.001))
        except StoreTimeout:
            pass

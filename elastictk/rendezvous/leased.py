"""Joining a round on a store that orders arrivals itself (etcd), as etcd is meant to be used.

Apart from the counter-and-slot join (:mod:`elastictk.rendezvous.handler`) because on etcd a
shared counter is the one thing to avoid: every joiner's compare-and-set on it races every
other's (K joiners cost about K**2/2 transactions; 512 never formed). Here a join is:

1. one read: ``latest``, the shutdown note, the expected round's size record (as everywhere);
2. one transaction (``Store.arrive``): unless the round's result exists,
   create ``r/<n>/a/<node_id>`` (its sealed NodeRecord) under this node's lease, and create
   ``r/<n>/closer`` if absent: the round's one closer is elected in the same request;
3. one read of ``r/<n>/to/<node_id>`` and one watch stream on it (``Store.await_value``),
   woken once, when the closer writes every assignment in bulk. Arrivals the round leaves out
   get a note there saying so (they join the next round).

A waiter looks again only when ``heartbeat_timeout`` passes without its assignment: if the
closer's key is gone (its lease ran out: the closer died), it claims the role with one
create-if-absent; the new closer finds a result already written, if any, and publishes it.
Liveness of the closer is etcd's lease, renewed by the heartbeat thread; nobody judges a
counter to elect one.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Literal

from ..lifetime.sigflag import SignalFlag
from ..store import StoreError
from ..store.etcd_leased import LeaseExpired
from .closing import closed
from .decide import Arrival
from .errors import RendezvousStateError, RendezvousTimeout
from .records import (
    Assignment, NodeRecord, arrival_key, closer_key, decode_assignment, decode_node, decode_note, encode_note,
    round_key, size_key, to_key,
)
from .waiting import WaitingReporter

if TYPE_CHECKING:
    from ..store import Store
    from .auth import Signer
    from .config import RendezvousConfig
    from .records import RoundResult, RoundSize

log = logging.getLogger("elastictk.rendezvous")


class LeaseBox:
    """This node's lease, shared by the join and the heartbeat thread that renews it; a new one
    is granted when the old ran out (a node stalled past its TTL)."""

    def __init__(self, store: "Store", ttl: float) -> None:
        self._store, self.ttl = store, ttl
        self._lock = threading.Lock()
        self.id = store.grant_lease(ttl)

    def renew(self, store: "Store") -> None:
        """One keepalive (on the heartbeat's own connection); a lost lease is replaced."""
        lease = self.id
        try:
            store.keepalive(lease)
        except LeaseExpired:
            self.regrant(lease, store)

    def regrant(self, old: int, store: "Store | None" = None) -> int:
        with self._lock:
            if self.id == old:
                self.id = (store or self._store).grant_lease(self.ttl)
            return self.id


class LeasedJoin:
    """The ordered-arrival join of :class:`~elastictk.rendezvous.handler.RendezvousHandler` (a mixin)."""

    if TYPE_CHECKING:  # what the handler provides
        store: Store
        signer: Signer
        node_id: str
        meta: dict[str, Any]
        config: RendezvousConfig
        _lease: LeaseBox | None
        _arrival_cursor: dict[int, int]  # per round: the revision the closer has read up to
        _deadline: float
        _interrupted: SignalFlag
        _clock: Callable[[], float]

        def _k(self, key: str) -> str: ...
        def _ignore(self, key: str, why: str) -> None: ...
        def _check_interrupted(self) -> None: ...
        def _member_of(self) -> int | None: ...
        def _raise_if_shut_down(self) -> None: ...
        def _say_if_spare(self, n: int) -> None: ...
        def _spare_for(self, n: int) -> RoundSize | None: ...
        def _size(self, n: int, raw: bytes | None | object = ...) -> RoundSize | None: ...
        def _say_waiting(self, n: int, left: float) -> None: ...
        def _close(self, n: int, records: dict[int, Arrival | None], opened_at: float) -> Assignment | None: ...
        def verified(self, key: str, raw: bytes | None) -> bool: ...
        def _decode_result(self, key: str, raw: bytes | None) -> RoundResult | None: ...

    def _arrive(self, n: int) -> tuple[bool, bool]:
        """Step 2 of the join: ``(arrived, closer)``; a lease that ran out is granted anew."""
        assert self._lease is not None
        key = arrival_key(n, self.node_id)
        record = NodeRecord(self.node_id, self.meta, self._member_of()).to_json(self.signer, self._k(key))
        unless = [round_key(n, "result")]
        for _ in range(3):
            lease = self._lease.id
            try:
                arrived, closer = self.store.arrive(key, record, lease, unless=unless,
                                                    claim=(closer_key(n), self.node_id.encode()))
            except LeaseExpired:
                self._lease.regrant(lease)
                continue
            if arrived or not unless or self._decode_result(unless[0], self.store.try_get(unless[0])) is not None:
                return arrived, closer
            # A result that does not verify (a stranger's) is absent: the closer replaces it.
            # Arrive past it; should the real result come first after all, we learn so from
            # the round's size record when our wait runs out.
            unless = []
        raise StoreError(f"{self.store.describe()}: every lease granted to node {self.node_id} was gone "
                         "before it could use it; is etcd's clock (or this node) stalling?")

    def _join_leased(self, n: int) -> Assignment | None:
        """Join round ``n``; this node's assignment, or None when the round closed without it."""
        arrived, closer = self._arrive(n)
        if not arrived:
            self._raise_if_shut_down()
            return None  # the round closed before we came: the next one
        self._say_if_spare(n)
        opened_at = self._clock()
        if closer:
            return self._close(n, {}, opened_at)
        cfg = self.config
        mine = to_key(n, self.node_id)
        spare = self._spare_for(n) is not None
        reporter = WaitingReporter(opened_at)
        lease_at = self._lease.id if self._lease is not None else 0
        while True:
            self._check_interrupted()
            left = self._deadline - self._clock()
            raw = self.store.await_value(mine, max(0.001, min(max(cfg.heartbeat_timeout, 1.0), left)),
                                         stop=self._interrupted.is_set)
            self._check_interrupted()
            got: Assignment | None | Literal[False] = False if raw is None else self._told(n, mine, raw)
            if got is not False:
                return got
            elif raw is not None:  # bytes that do not verify: look again after a while, not at once
                self._interrupted.wait(max(0.0, min(cfg.heartbeat_timeout, self._deadline - self._clock())))
            closer_raw, size_raw, shut = self.store.multi_get([closer_key(n), size_key(n), "shutdown"])
            if self.verified("shutdown", shut):
                self._raise_if_shut_down()
            if self._size(n, size_raw) is not None:
                raw = self.store.try_get(mine)  # written before the size record: here now
                got = None if raw is None else self._told(n, mine, raw)
                return None if got is False else got
            if self._lease is not None and self._lease.id != lease_at:
                # Our lease ran out while we waited (this host stalled past its TTL): etcd took
                # our arrival with it, so no closer would count us. Arrive anew under the new one.
                lease_at = self._lease.id
                arrived, closer = self._arrive(n)
                if not arrived:
                    self._raise_if_shut_down()
                    return None
                if closer:
                    return self._close(n, {}, opened_at)
            elif closer_raw is None and self._claim_closer(n):
                return self._close(n, {}, opened_at)
            now = self._clock()
            if spare:
                self._deadline = max(self._deadline, now + cfg.join_timeout)
            elif now >= self._deadline:
                raise RendezvousTimeout(
                    f"round {n} of job {cfg.job_id!r} did not form within the join timeout of "
                    f"{cfg.join_timeout:g}s; start more nodes or lower --nnodes MIN"
                )
            elif reporter.due(now):
                self._say_waiting(n, self._deadline - now)

    def _claim_closer(self, n: int) -> bool:
        assert self._lease is not None
        lease = self._lease.id
        try:
            return self.store.claim(closer_key(n), self.node_id.encode(), lease)
        except LeaseExpired:
            return self.store.claim(closer_key(n), self.node_id.encode(), self._lease.regrant(lease))

    def _told(self, n: int, key: str, raw: bytes) -> Assignment | None | Literal[False]:
        """What the closer wrote to this node: its assignment, None (left out of round ``n``:
        the next one), or False (bytes that do not verify: absent, looked at again)."""
        try:
            note = decode_note(self._k(key), raw, self.signer)
            if note.get("member") is False and note.get("round") == n:
                return None
            if isinstance(note.get("shutdown"), str):
                raise closed(self.config.job_id, note["shutdown"][:200])
            return decode_assignment(self._k(key), raw, self.signer)
        except RendezvousStateError as e:  # a stranger's, or garbage: absent, never a crash
            self._ignore(key, str(e))
            return False

    # -- the closer's side ------------------------------------------------------------------------
    def _read_arrivals(self, n: int, cache: dict[int, Arrival | None]) -> int:
        """Arrivals of round ``n`` created since the last read, appended to ``cache`` in creation
        order (seq 1, 2, ...); how many are cached. Each arrival is read once."""
        cursors = self._arrival_cursor
        if not cache:
            cursors[n] = 0
        prefix = round_key(n, "a") + "/"
        items, cursors[n] = self.store.created_since(prefix, cursors.get(n, 0))
        for name, raw in items:
            seq = len(cache) + 1
            key = prefix + name
            try:
                rec = decode_node(self._k(key), raw, self.signer)
                cache[seq] = Arrival(seq, rec.node_id, rec.meta) if rec.node_id == name else None
            except RendezvousStateError as e:  # a stranger's join: never counted
                self._ignore(key, str(e))
                cache[seq] = None
        return len(cache)

    def _wait_arrivals(self, n: int, have: int, want: int, timeout: float) -> None:
        cursors = self._arrival_cursor
        self.store.wait_created(round_key(n, "a") + "/", cursors.get(n, 0), max(1, want - have),
                                max(timeout, 0.001))

    def _left_out(self, n: int, members: set[str], cache: dict[int, Arrival | None]) -> list[tuple[str, bytes]]:
        """Notes for every arrival of round ``n`` that is not a member (written with the
        assignments): the result exists, so no arrival comes after this read."""
        self._read_arrivals(n, cache)
        out = []
        for a in cache.values():
            if a is not None and a.node_id not in members:
                key = to_key(n, a.node_id)
                out.append((key, encode_note(self.signer, self._k(key), round=n, member=False)))
        return out

    def _tell_shutdown(self, n: int, reason: str) -> None:
        """Every node waiting in round ``n`` (still open) is told the job ended."""
        if self._size(n) is not None:
            return
        cache: dict[int, Arrival | None] = {}
        self._read_arrivals(n, cache)
        items = [(to_key(n, a.node_id), encode_note(self.signer, self._k(to_key(n, a.node_id)), shutdown=reason))
                 for a in cache.values() if a is not None]
        if items:
            self.store.multi_set(items)

"""A membership-changed signal for a running round: a node waits to join, or a peer is lost.

Each node blocks on the next round's arrival counter (the store wakes it the moment anyone
arrives) and watches the heartbeats of its two ring successors only, so a K-node job costs the
store O(K) heartbeat reads per interval in total, not O(K^2). Two adjacent nodes dying together
are still caught: the next round's closer checks every previous member.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from functools import cached_property
from typing import TYPE_CHECKING, Callable

from ..store import StoreClosed, StoreError, StoreTimeout, StoreUnreachable
from ..store.base import CreatedWatch
from .errors import RendezvousError
from .leasering import LeaseRing
from .liveness import LivenessTracker, read_counters
from .records import decode_node, round_key, slot_key
from .sealed import parse_counter

if TYPE_CHECKING:
    from .handler import RendezvousHandler, RoundInfo

log = logging.getLogger("elastictk.rendezvous")
ARRIVALS_PAGE = 8  # arrivals of the next round a watcher reads per request


class MembershipWatch:
    """Sets :attr:`changed` (a ``threading.Event``) with a one-line :attr:`reason`."""

    def __init__(
        self,
        handler: "RendezvousHandler",
        info: "RoundInfo",
        successors: int = 2,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.info = info
        self._on_change = on_change
        self.reason: str | None = None
        self.lost: list[str] = []
        self._revision = 0  # on etcd: the next round's arrivals read up to this revision
        self._creations: CreatedWatch | None = None  # on etcd: the stream on them
        self._ring: LeaseRing | None = None  # on etcd: the successors' leases, watched
        self._strangers: set[int] = set()  # slots of round+1 that never wake us (strangers, spares)
        # A full round is not re-formed for a newcomer: it waits as a spare (decide.held) until
        # a member is lost or leaves; only a member's own arrival for the next round wakes us.
        self._full = info.world_size >= handler.config.max_nodes
        self.store_error: StoreError | None = None
        self.changed = threading.Event()
        self._handler = handler
        self._store = handler.store.clone()
        self._stop = threading.Event()
        # The ring successors come with this node's assignment (no member list is read).
        ring = info.ring[:successors]
        self._watched = {node: (info.rank + k) % max(info.world_size, 1) for k, node in enumerate(ring, 1)
                         if node != handler.node_id}
        self._thread = threading.Thread(target=self._run, name=f"elastictk-watch-r{info.round}", daemon=True)
        self._thread.start()
        self._fence_thread = threading.Thread(target=self._fence, name=f"elastictk-fence-r{info.round}", daemon=True)
        self._fence_thread.start()

    def _fence(self) -> None:
        """Signal when this node's own heartbeat has not reached the store for the timeout.

        Its peers then count it as lost and form a round without it (split brain otherwise),
        and every store call of this node may hang on the dead link; this thread makes no
        store call, so it notices on its own clock and the agent stops its workers.
        """
        try:
            self._fence_loop()
        except Exception as e:  # noqa: BLE001 - never die silently: log the cause, wake the agent
            log.error("membership fence of round %d stopped: %r", self.info.round, e, exc_info=True)
            self.store_error = StoreError(f"the membership fence failed: {e!r}")
            self._signal(str(self.store_error))

    def _fence_loop(self) -> None:
        cfg = self._handler.config
        while not self._stop.wait(cfg.heartbeat_interval):
            silent = self._handler.heartbeat_silence()
            if silent >= cfg.heartbeat_timeout and not self.changed.is_set():
                last = self._handler.heartbeat_error
                idle = self._handler.heartbeat_unscheduled()
                if last:
                    why = f"the last attempt: {last}"
                elif idle >= cfg.heartbeat_interval + 1.0:
                    why = (f"its heartbeat thread did not run for {idle:.1f}s: this host is overloaded "
                           f"(load average {os.getloadavg()[0]:.0f} on {os.cpu_count()} cores); raise "
                           "--rdzv-conf heartbeat_timeout (default 10) above the stalls this host has")
                else:
                    why = "check the network between this host and the store"
                self.store_error = StoreUnreachable(
                    f"node {self._handler.node_id}'s heartbeat has not reached the rendezvous store for "
                    f"{silent:.1f}s (heartbeat_timeout {cfg.heartbeat_timeout:g}s): its peers count it as "
                    f"lost, so it stops its workers; {why}"
                )
                self._signal(str(self.store_error))
                return

    def _signal(self, reason: str) -> None:
        if self._stop.is_set():
            # Stopped: nobody listens, and the callback's target may be gone (an agent that
            # returned without waiting for this thread has closed its worker group).
            return
        self.reason = reason
        self.changed.set()
        if self._on_change is not None:
            self._on_change()

    def _run(self) -> None:
        cfg = self._handler.config
        self._tracker = LivenessTracker(cfg.heartbeat_timeout)
        self._wait_key = round_key(self.info.round + 1, "arrivals")
        failing_since: float | None = None
        try:
            while not self._stop.is_set():
                try:
                    if self._poll():
                        return
                    failing_since = None
                except StoreError as e:
                    # A store that is briefly unavailable (an etcd leader election after a
                    # member died, a slow failover) is not a lost store: retry it until
                    # heartbeat_timeout. Heartbeats are judged afresh afterwards, since the
                    # peers could not beat while the store was away either.
                    now = time.monotonic()
                    failing_since = failing_since or now
                    if isinstance(e, StoreClosed) or now - failing_since >= cfg.heartbeat_timeout:
                        raise
                    self._tracker = LivenessTracker(cfg.heartbeat_timeout)
                    self._stop.wait(min(cfg.heartbeat_interval, 0.5))
                except RendezvousError:
                    raise
                except Exception as e:  # noqa: BLE001 - a bug or garbage we did not foresee: ride it
                    # through like a store that is briefly unavailable, logged with its cause;
                    # if it persists for heartbeat_timeout the agent is woken as for a lost store.
                    log.warning("membership watch of round %d: %r", self.info.round, e, exc_info=True)
                    now = time.monotonic()
                    failing_since = failing_since or now
                    if now - failing_since >= cfg.heartbeat_timeout:
                        raise StoreError(f"the membership watch keeps failing: {e!r}") from e
                    self._stop.wait(min(cfg.heartbeat_interval, 0.5))
        except StoreError as e:
            self.store_error = e
            self._signal(f"lost the rendezvous store: {e}")
        except RendezvousError as e:  # garbage in the store: the agent ends with the key named
            self.store_error = StoreError(str(e))
            self._signal(str(e))
        except BaseException as e:  # never die silently: log the cause, wake the agent
            log.error("membership watch of round %d stopped: %r", self.info.round, e, exc_info=True)
            self.store_error = StoreError(f"the membership watch failed: {e!r}")
            self._signal(str(self.store_error))
        finally:
            if self._creations is not None:
                self._creations.close()
            if self._ring is not None:
                self._ring.close()
            self._store.close()

    def _poll(self) -> bool:
        """One heartbeat interval of watching; True once it has signalled a change."""
        cfg = self._handler.config
        nxt = self.info.round + 1
        if self._store.ordered_arrivals:
            return self._poll_ordered(nxt)
        next_arrivals = round_key(nxt, "arrivals")
        woke = False
        try:
            self._store.wait([self._wait_key], cfg.heartbeat_interval)
            if self._stop.is_set():
                return True
            if self._handler.verified("shutdown", self._store.try_get("shutdown")):
                self._signal("the job was shut down")
                return True
            self._wait_key, woke = next_arrivals, True
        except StoreTimeout:
            pass
        # A wait on the arrival counter that timed out found none: no read to confirm it (one
        # request a second per node); one written since wakes the next wait at once.
        if woke or self._wait_key != next_arrivals:
            count = parse_counter(self._store.try_get(next_arrivals), self._handler.arrival_cap)
            first_unread = self._first_joiner(nxt, count)
            if first_unread is None:
                self._signal(f"round {nxt} opened: {count} node(s) arrived")
                return True
            self._wait_key = slot_key(nxt, first_unread)  # only strangers so far: wait for more
        return self._ring_lost()

    def _poll_ordered(self, nxt: int) -> bool:
        """:meth:`_poll` on a store that orders arrivals (etcd): one watch on round ``nxt``'s
        arrival keys from the revision read last, and only new arrivals are read."""
        prefix = round_key(nxt, "a") + "/"
        if self._creations is None:  # one stream for the whole round, not one per interval
            self._creations = self._store.watch_created(prefix, self._revision)
        try:
            came = self._creations.wait(self._handler.config.heartbeat_interval)
        except BaseException:
            self._creations.close()
            self._creations = None
            raise
        if came:
            if self._stop.is_set():
                return True
            if self._handler.verified("shutdown", self._store.try_get("shutdown")):
                self._signal("the job was shut down")
                return True
            # A page at a time: when a whole job re-forms, every watcher wakes as the arrivals
            # pour in, and one that read all of them would make N watchers read O(N) each.
            while True:
                items, self._revision = self._store.created_since(prefix, self._revision, limit=ARRIVALS_PAGE)
                for name, raw in items:
                    key = prefix + name
                    if not self._handler.signer.enabled and not self._full:
                        self._signal(f"round {nxt} opened: node {name} arrived")
                        return True
                    if self._handler.verified(key, raw) and self._wakes(key, raw):
                        self._signal(f"round {nxt} opened: node {name} arrived")
                        return True
                if len(items) < ARRIVALS_PAGE:
                    break
        return self._ring_lost()

    def _ring_lost(self) -> bool:
        """Read the ring successors' heartbeats once; True (and signalled) when one is lost."""
        now = time.monotonic()
        if self._store.lease_liveness:
            return self._ring_lost_leased(now)
        tracker = self._tracker
        for node_id, value in read_counters(self._store, list(self._watched), self._handler.left_check).items():
            tracker.observe(node_id, value, now)
            if tracker.is_dead(node_id, now):
                silent = tracker.silent_for(node_id, now)
                self._lose(node_id, f"node {node_id} (rank {self._watched[node_id]}) lost: no heartbeat for "
                                    f"{silent:.1f}s")
                return True
        return False

    def _ring_lost_leased(self, now: float) -> bool:
        """:meth:`_ring_lost` by the successors' leases (:mod:`elastictk.rendezvous.leasering`):
        no request while their keys are untouched."""
        if self._ring is None:
            self._ring = LeaseRing(self._store, list(self._watched), self._handler.config.heartbeat_timeout)
        found = self._ring.lost(now, self._handler.left_check)
        if found is None:
            return False
        node_id, what = found
        self._lose(node_id, f"node {node_id} (rank {self._watched[node_id]}) lost: {what}")
        return True

    def _lose(self, node_id: str, why: str) -> None:
        note = self._handler.note(f"lost/{node_id}", by=self._handler.node_id, reason=why)
        self._handler.claim_note(f"lost/{node_id}", note, store=self._store)
        self.lost.append(node_id)
        self._signal(why)

    def _first_joiner(self, n: int, count: int) -> int | None:
        """None when a node of this job (its join record signed with the token) arrived for
        round ``n`` and should make the round re-form; else the first slot not yet written, to
        wait on. A stranger's arrival (an unsigned or forged record) never makes the job
        re-form, nor, while this round runs full, a spare's."""
        if not self._handler.signer.enabled and not self._full:
            return None
        seqs = [s for s in range(1, count + 1) if s not in self._strangers]
        first_unread = count + 1
        # A page at a time: when a whole job re-forms, a watcher that wakes late would otherwise
        # read every arrival so far (O(N) each, O(N^2) for the job) to find the first that wakes it.
        for i in range(0, len(seqs), ARRIVALS_PAGE):
            page = seqs[i:i + ARRIVALS_PAGE]
            for seq, raw in zip(page, self._store.multi_get([slot_key(n, s) for s in page])):
                if raw is None:
                    first_unread = min(first_unread, seq)
                elif self._handler.verified(slot_key(n, seq), raw) and self._wakes(slot_key(n, seq), raw):
                    return None
                else:
                    self._strangers.add(seq)
        return first_unread

    def _wakes(self, key: str, raw: bytes) -> bool:
        """Whether a (verified) arrival re-forms the round: any, unless the round runs full;
        then only a member's (it left the running round: a failure, a restart, its exit)."""
        if not self._full:
            return True
        try:
            record = decode_node(f"{self._handler.prefix}/{key}", raw, self._handler.signer)
        except RendezvousError:
            return False  # garbage without a token: the next round's closer names it
        node_id = record.node_id
        if record.member_of is not None:  # it says which round it ran in (sealed with a token)
            if record.member_of == self.info.round:
                return True
        elif node_id in self._members:  # read only here: an arrival that does not say (a restarted agent)
            return True
        log.debug("node %s arrived for the next round as a spare: the running round is full", node_id)
        return False

    @cached_property
    def _members(self) -> set[str]:
        """The round's members, read on this thread's own connection (the handler's is the
        agent's, and a store client is not shared by threads that block)."""
        if "members" in self.info.__dict__:  # already read by the agent
            return {m.node_id for m in self.info.members}
        key = round_key(self.info.round, "result")
        result = self._handler._decode_result(key, self._store.try_get(key))
        return set() if result is None else {m.node_id for m in result.members}

    @property
    def cause(self) -> str:
        """What changed, as a word for events and decisions: store_lost, lost_node, shutdown
        or node_joined (a new round opened)."""
        if self.store_error is not None:
            return "store_lost"
        if self.lost:
            return "lost_node"
        if self.reason and "shut down" in self.reason:
            return "shutdown"
        return "node_joined"

    def wait(self, timeout: float | None = None) -> bool:
        return self.changed.wait(timeout)

    def stop(self, wait: bool = False) -> None:
        """Stop watching. Without ``wait`` this returns at once: the thread may sit in a store
        wait for up to a heartbeat interval, and an agent reacting to a failure must not sit
        there with it. The thread ends by itself and closes its own store connection."""
        self._stop.set()
        if wait:
            self._thread.join(timeout=self._handler.config.heartbeat_interval + 5)

"""Heartbeats: a counter each node bumps, and observers that judge by their own clock.

Nodes never compare timestamps: a node is lost when its counter has not moved for
``timeout`` seconds of the *observer's* monotonic time. A host whose wall clock is 30 s off is
therefore judged like any other, and a clock jump cannot kill a healthy node.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from ..store import Store, StoreError
from ..store.base import KeysWatch
from .records import hb_key

LEFT = -1  # the counter value a node sets when it leaves on purpose
ALIVE = b"alive"  # on a store with lease liveness: the node's key, kept under its lease
_TICK = itertools.count(1)  # a key seen under its lease reads as a counter that moved


@dataclass
class _Seen:
    value: int | None
    changed_at: float


class LivenessTracker:
    """Pure bookkeeping of heartbeat observations (time is passed in)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._seen: dict[str, _Seen] = {}

    def observe(self, node_id: str, value: int | None, now: float) -> None:
        """Record one reading of a node's counter (``None``: the key is absent)."""
        seen = self._seen.get(node_id)
        if seen is None:
            self._seen[node_id] = _Seen(value, now)
        elif seen.value != value:
            seen.value, seen.changed_at = value, now

    def is_dead(self, node_id: str, now: float) -> bool:
        seen = self._seen.get(node_id)
        if seen is None:
            return False
        if seen.value == LEFT:
            return True
        return now - seen.changed_at >= self.timeout

    def silent_for(self, node_id: str, now: float) -> float:
        seen = self._seen.get(node_id)
        return 0.0 if seen is None else now - seen.changed_at

    def forget(self, node_id: str) -> None:
        self._seen.pop(node_id, None)


def read_counters(store: Store, node_ids: list[str],
                  left_is_signed: Callable[[str, bytes | None], bool] | None = None) -> dict[str, int | None]:
    """Heartbeat counters of ``node_ids`` in one batched read where the store allows.

    With a job token a counter set to ``LEFT`` counts as a departure only when the node's
    ``left/<node_id>`` note is signed (``left_is_signed``): anyone can write -1 into a counter.
    """
    keys = [hb_key(n) for n in node_ids]
    # With lease liveness (etcd) a key present under a lease is a beat seen now: etcd deletes
    # it when the lease ends. Absent, or rewritten without the lease (a stranger's set), it
    # is silent; its owner puts it back under its lease within a heartbeat interval.
    if store.lease_liveness:
        got = store.leased_get(keys)[0]
        values = [v for v, _ in got]
        alive = [v is not None and bool(lease) for v, lease in got]
    else:
        values, alive = store.multi_get(keys), [False] * len(keys)
    out: dict[str, int | None] = {}
    for node_id, raw, live in zip(node_ids, values, alive):
        if live:
            out[node_id] = next(_TICK)
            continue
        try:
            out[node_id] = None if raw is None else int(raw.decode("ascii").strip()[:32])
        except (UnicodeDecodeError, ValueError):
            out[node_id] = None  # not a counter: judged as absent (silent), never a crash
        if store.lease_liveness and out[node_id] != LEFT:
            out[node_id] = None  # a value without the lease is no beat
        if out[node_id] == LEFT and left_is_signed is not None:
            key = f"left/{node_id}"
            if not left_is_signed(key, store.try_get(key)):
                out[node_id] = None  # not believed: judged by its counter moving, as before
    return out


def await_departures(store: Store, node_ids: list[str], timeout: float, heartbeat_timeout: float,
                     left_is_signed: Callable[[str, bytes | None], bool] | None,
                     pause: Callable[[float], bool]) -> list[str]:
    """Until every node of ``node_ids`` has left (its heartbeat says so) or fallen silent for
    ``heartbeat_timeout``, at most ``timeout`` seconds; returns those still beating. ``pause``
    waits between looks and returns True to stop waiting (an interrupt)."""
    tracker = LivenessTracker(heartbeat_timeout)
    deadline = time.monotonic() + timeout
    left = list(node_ids)
    while left:
        now = time.monotonic()
        try:
            for node_id, value in read_counters(store, left, left_is_signed).items():
                tracker.observe(node_id, value, now)
        except StoreError:
            return left
        left = [n for n in left if not tracker.is_dead(n, now)]
        if not left or pause(min(0.2, max(0.0, deadline - now))) or now >= deadline:
            break
    return left


class Renewable(Protocol):
    """A lease the heartbeat renews (:class:`~elastictk.rendezvous.leased.LeaseBox`)."""

    ttl: float
    id: int

    def renew(self, store: Store) -> None: ...


class Heartbeat:
    """A daemon thread that keeps this node alive in the store every ``interval`` seconds.

    On most stores it bumps the node's counter. On a store with lease liveness (etcd) it puts
    the node's key under the node's lease once and then only renews the lease (a keepalive is
    not a replicated write; 1,024 counter bumps a second are), putting the key back should
    anyone delete it or rewrite it without the lease (one watch stream tells it so).
    It has its own store connection (a blocking call on the shared one would stall it) and
    remembers the last store error, so the agent can tell "the store is gone" from "a peer is".
    """

    def __init__(self, store: Store, node_id: str, interval: float,
                 left_note: bytes | Callable[[], bytes] | None = None, lease: Renewable | None = None) -> None:
        self._store = store.clone()
        self._key = hb_key(node_id)
        self._left = (f"left/{node_id}", left_note)  # written before the LEFT mark, when given
        self._interval = interval
        self._stop = threading.Event()
        self.last_error: StoreError | None = None
        # On etcd the node's lease (its arrival keys, its claim to close a round, its key of
        # liveness) is renewed every third of its TTL.
        self._lease = lease
        self._renew_every = max(1, int(lease.ttl / 3 / interval)) if lease is not None else 0
        self._leased = lease is not None and self._store.lease_liveness
        self._own: KeysWatch | None = None
        if self._leased:  # the first beat is synchronous: the key exists on return
            self._put_alive()
        else:
            self._store.add(self._key, 1)
        self.last_ok = time.monotonic()  # when a beat last reached the store (local clock)
        self.last_try = self.last_ok  # when the thread last woke to beat (a starved host: long ago)
        self._thread = threading.Thread(target=self._run, name=f"elastictk-heartbeat-{node_id}", daemon=True)
        self._thread.start()

    def _put_alive(self) -> None:
        """The node's key under its current lease, and the watch that tells when it changes."""
        assert self._lease is not None
        self._store.set_with_lease(self._key, ALIVE, self._lease.id)
        if self._own is None:
            self._own = self._store.watch_keys([self._key], self._store.leased_get([self._key])[1])

    def _run(self) -> None:
        beats = 0
        while not self._stop.wait(self._interval):
            self.last_try = time.monotonic()
            try:
                if self._leased:
                    self._beat_leased(beats)
                else:
                    self._store.add(self._key, 1)
                    if self._lease is not None and (beats + 1) % self._renew_every == 0:
                        self._lease.renew(self._store)
                    self.last_ok = time.monotonic()
                beats += 1
                self.last_error = None
            except StoreError as e:
                self.last_error = e

    def _beat_leased(self, beats: int) -> None:
        """Renew the lease when due (every beat after a failure); put the key back when the
        lease was replaced or anyone touched the key (the watch says so, at no request)."""
        assert self._lease is not None and self._own is not None
        touched = bool(self._own.touched())
        if self.last_error is not None or (beats + 1) % self._renew_every == 0:
            before = self._lease.id
            self._lease.renew(self._store)  # a lease that ran out is granted anew
            self.last_ok = time.monotonic()
            touched = touched or self._lease.id != before
        if touched:
            (value, lease), = self._store.leased_get([self._key])[0]
            if value != ALIVE or lease != self._lease.id:
                self._put_alive()

    @property
    def _period(self) -> float:
        """How often a beat reaches the store: every interval, or every renewal of the lease."""
        return self._interval * (self._renew_every if self._leased else 1)

    def silent_for(self) -> float:
        """Seconds since a beat (on etcd: a keepalive) last reached the store, on this node's
        monotonic clock."""
        return time.monotonic() - self.last_ok

    def unscheduled_for(self) -> float:
        """Seconds since the beating thread last woke: long when this host is CPU-starved."""
        return time.monotonic() - self.last_try

    def stop(self, leaving: bool = False) -> None:
        """Stop beating; ``leaving`` marks the node as gone at once instead of after a timeout.

        A node whose beats stopped reaching the store (a cut link) does not try to say
        goodbye: that write would block on the dead connection, and its peers already know.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        cut_off = self.silent_for() > 2 * self._period + 1
        self._thread.join(timeout=0 if cut_off else self._interval + 5)
        if leaving and not cut_off:
            try:
                note = self._left[1]
                if note is not None:
                    self._store.set(self._left[0], note() if callable(note) else note)
                self._store.set(self._key, str(LEFT).encode())
            except StoreError:
                pass
        if self._own is not None:
            self._own.close()
        self._store.close()

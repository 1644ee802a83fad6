"""The etcd join (lease-ordered arrivals, a closer elected by create-if-absent) under
adversarial interleavings: the model store of ``test_rdzv_protocol_props`` with etcd's ordered
arrivals and leases added, and the same verdicts (one closer's result won per round, ranks
0..N-1 once each, each node's assignment agrees with the result, only closers read the member
list). A closer that dies after its result stops renewing its lease: its claim to close
vanishes when the lease runs out, and a waiter takes over and publishes that result.
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastictk.rendezvous import RendezvousConfig, RendezvousHandler
from elastictk.store.etcd_leased import LeaseExpired
from tests.test_rdzv_protocol_props import ModelStore, _run

_ids = itertools.count(1)


class OrderedModelStore(ModelStore):
    """:class:`ModelStore` with etcd's creation order (a revision per write) and leases that
    run out ``ttl`` seconds after their last renewal (checked at every call)."""

    ordered_arrivals = True

    def __init__(self, seed: int, jitter: float, shared: "ModelStore | None" = None, owner: str = "") -> None:
        super().__init__(seed, jitter, shared, owner)
        # keys: key -> (create revision, lease); leases: id -> (ttl, renewed at); rev: the revision
        self._meta: dict[str, Any] = (shared._meta if isinstance(shared, OrderedModelStore)
                                      else {"keys": {}, "leases": {}, "rev": [0]})

    def _expire(self) -> None:  # under the condition variable
        now = time.monotonic()
        leases = self._meta["leases"]
        for lid, (ttl, at) in list(leases.items()):
            if now - at > ttl:
                del leases[lid]
                for k, (_, lease) in list(self._meta["keys"].items()):
                    if lease == lid:
                        self._data.pop(k, None)
                        del self._meta["keys"][k]
                self._cv.notify_all()

    def _create(self, key: str, value: bytes, lease: int | None) -> None:
        self._meta["rev"][0] += 1
        self._data[key] = bytes(value)
        self._meta["keys"][key] = (self._meta["rev"][0], lease)
        self._cv.notify_all()

    def _live(self, lease: int) -> None:
        self._expire()
        if lease not in self._meta["leases"]:
            raise LeaseExpired(f"model lease {lease} expired")

    def set(self, key: str, value: bytes) -> None:
        super().set(key, value)
        with self._cv:
            self._meta["keys"].setdefault(key, (self._bump(), None))

    def multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        super().multi_set(items)
        with self._cv:
            for k, _ in items:
                self._meta["keys"].setdefault(k, (self._bump(), None))

    def _bump(self) -> int:
        self._meta["rev"][0] += 1
        return int(self._meta["rev"][0])

    def grant_lease(self, ttl: float) -> int:
        with self._cv:
            lid = next(_ids)
            self._meta["leases"][lid] = (ttl, time.monotonic())
            return lid

    def keepalive(self, lease_id: int) -> float:
        with self._cv:
            self._live(lease_id)
            ttl = self._meta["leases"][lease_id][0]
            self._meta["leases"][lease_id] = (ttl, time.monotonic())
            return float(ttl)

    def revoke(self, lease_id: int) -> bool:
        with self._cv:
            if lease_id not in self._meta["leases"]:
                return False
            self._meta["leases"][lease_id] = (0.0, 0.0)
            self._expire()
            return True

    def arrive(self, key: str, value: bytes, lease: int, *, unless: Sequence[str] = (),
               claim: tuple[str, bytes] | None = None) -> tuple[bool, bool]:
        self._pause()
        with self._cv:
            self._live(lease)
            if any(u in self._data for u in unless):
                return False, False
            self._create(key, value, lease)
            if claim is None or claim[0] in self._data:
                return True, False
            self._create(claim[0], claim[1], lease)
            return True, True

    def claim(self, key: str, value: bytes, lease: int) -> bool:
        self._pause()
        with self._cv:
            self._live(lease)
            if key in self._data:
                return False
            self._create(key, value, lease)
            return True

    def _since(self, prefix: str, revision: int) -> list[tuple[int, str]]:
        return sorted((rev, k) for k, (rev, _) in self._meta["keys"].items()
                      if k.startswith(prefix) and rev > revision and k in self._data)

    def created_since(self, prefix: str, revision: int, limit: int = 0) -> tuple[list[tuple[str, bytes]], int]:
        self._pause()
        with self._cv:
            self._expire()
            got = self._since(prefix, revision)[:limit or None]
            return ([(k[len(prefix):], self._data[k]) for _, k in got], max([revision] + [r for r, _ in got]))

    def wait_created(self, prefix: str, revision: int, count: int, timeout: float) -> bool:
        self._pause()
        with self._cv:
            def enough() -> bool:
                self._expire()
                return len(self._since(prefix, revision)) >= count
            return self._cv.wait_for(enough, timeout=min(timeout, 30.0))

    def count(self, prefix: str) -> int:
        with self._cv:
            self._expire()
            return sum(1 for k in self._data if k.startswith(prefix))

    def await_value(self, key: str, timeout: float, stop: Callable[[], bool] | None = None) -> bytes | None:
        self._pause()
        deadline = time.monotonic() + timeout
        with self._cv:
            while key not in self._data:
                left = deadline - time.monotonic()
                if left <= 0 or (stop is not None and stop()):
                    return None
                self._cv.wait(min(left, 0.05))
                self._expire()
            return self._data[key]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 9), seed=st.integers(0, 2**16), jitter=st.sampled_from([0.0, 0.002, 0.01]))
def test_each_leased_round_has_one_closer_and_ranks_once_each(n: int, seed: int, jitter: float) -> None:
    _run(n, seed, jitter, kill_closer=False, model=OrderedModelStore)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(3, 6), seed=st.integers(0, 2**16))
def test_a_leased_closer_that_dies_before_the_assignments_is_replaced(n: int, seed: int) -> None:
    _run(n, seed, 0.002, kill_closer=True, model=OrderedModelStore)


def test_a_join_costs_three_calls_and_arrivals_are_read_once() -> None:
    """A node that is not the closer: one read, one arrival, one wait that returns its
    assignment; the closer reads each arrival once (by creation order, never a counter)."""
    cfg = RendezvousConfig("cost", min_nodes=3, max_nodes=3, last_call=5.0, join_timeout=60,
                           heartbeat_interval=0.05, heartbeat_timeout=2.0, token="s3cret")
    root = OrderedModelStore(1, 0.0)
    calls: dict[str, list[str]] = {}
    reads: list[int] = []

    class Counted(OrderedModelStore):
        def __getattribute__(self, name: str) -> object:
            got = object.__getattribute__(self, name)
            if name in ("try_get", "multi_get", "arrive", "await_value", "add", "set", "wait", "claim",
                        "created_since", "count", "compare_set", "multi_set", "keys") and not self.owner.endswith("+"):
                calls.setdefault(self.owner, []).append(name)
            return got

        def created_since(self, prefix: str, revision: int, limit: int = 0) -> tuple[list[tuple[str, bytes]], int]:
            got = super().created_since(prefix, revision, limit)
            reads.extend(1 for _ in got[0])
            return got

    hs = [RendezvousHandler(Counted(1, 0.0, shared=root, owner=f"n{i}"), cfg, node_id=f"n{i}") for i in range(3)]
    for h in hs:
        h.start_heartbeat()
    calls.clear()
    out: dict[str, object] = {}
    threads = [threading.Thread(target=lambda h=h: out.update({h.node_id: h.next_round()})) for h in hs]
    for t in threads:
        t.start()
        time.sleep(0.2)  # n0 arrives first: the closer
    for t in threads:
        t.join(30)
    for h in hs:
        h.close(leaving=False)
    assert len(out) == 3
    for node in ("n1", "n2"):
        assert calls[node] == ["multi_get", "arrive", "await_value"], calls[node]
    assert sum(reads) == 3, reads  # each arrival read once, by the closer

"""What a running round's watches ask the store while nothing happens (issue #39).

At 1,024 nodes every request a watch makes per interval is a thousand a second to one store,
and on the benchmark's shared cores a thousand client wake-ups: the failure watch waits on its
key and reads it only when the wait returns, and the membership watch reads the next round's
arrival counter only when its wait on that counter returns. Both still see what they watch at
once (the second half of each test). Counted with the benchmark's counting store (real
TCPStore and file store underneath: the stores without watch streams, where these reads were).
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import pytest

from bench._rdzv_scale_store import CountingStore, Tally
from elastictk.rendezvous import MembershipWatch, RendezvousHandler
from elastictk.rendezvous.records import round_key
from elastictk.rendezvous.auth import Signer
from elastictk.rendezvous.sealed import Follower, Records
from elastictk.store import FileStore, Store, TCPStore
from tests.helpers.rdzvjoin import end_joins, join_in_background
from tests.test_rendezvous import fast, infos, join_all


@pytest.fixture(params=["tcp", "file"])
def counted(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Callable[[], Store], Tally]]:
    """A factory of counted connections to one store (their clones counted in the same tally)."""
    tally, opened = Tally(), []
    server = TCPStore.serve(timeout=20) if request.param == "tcp" else None

    def make() -> Store:
        inner: Store = (TCPStore.connect(f"127.0.0.1:{server.port}", timeout=20) if server is not None
                        else FileStore(tmp_path / "store", timeout=20))
        opened.append(inner)
        return CountingStore(inner, tally)

    try:
        yield make, tally
    finally:
        for s in opened:
            s.close()
        if server is not None:
            server.close()


def test_the_failure_watch_waits_without_reading_until_its_key_is_written(
        counted: tuple[Callable[[], Store], Tally]) -> None:
    make, tally = counted
    store = make()
    records = Records(store, "job/r1", Signer("t0ken", "job"))
    watch = Follower(records, "failed")
    before = tally.snapshot()
    asks = 5
    for _ in range(asks):
        assert watch.wait(0.1) is None
    spent = tally.snapshot() - before
    # one read (the first ask's: the key may be there already), then waits only
    assert spent["get"] == 1 and spent["wait"] == asks, spent

    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(watch.wait(30.0)))
    t.start()
    time.sleep(0.2)  # the ask is blocked in its wait (not asserted: only the wake-up is)
    writer = records.view(make(), "job/r1")
    writer.write("failed", {"node_id": "n1", "headline": "rank 3 exited 1"})
    t.join(30)
    assert not t.is_alive(), "the watch woke when its key was written"
    assert got and isinstance(got[0], dict) and got[0]["node_id"] == "n1", got


def test_the_membership_watch_reads_no_arrival_counter_while_nobody_arrives(
        counted: tuple[Callable[[], Store], Tally], monkeypatch: pytest.MonkeyPatch) -> None:
    make, tally = counted
    hs = [RendezvousHandler(make(), fast("quiet", 2, 3, heartbeat_interval=0.1, heartbeat_timeout=5.0),
                            node_id=f"n{i}") for i in range(2)]
    watch: MembershipWatch | None = None
    threads: list[threading.Thread | None] = []
    try:
        info = infos(join_all(hs))["n0"]
        arrivals = round_key(info.round + 1, "arrivals")
        reads: Counter[str] = Counter()
        inner_get = CountingStore.try_get

        def counting_get(self: CountingStore, key: str) -> bytes | None:
            reads[key] += 1
            return inner_get(self, key)

        before = tally.snapshot()
        monkeypatch.setattr(CountingStore, "try_get", counting_get)
        watch = MembershipWatch(hs[0], info)
        time.sleep(1.0)  # ten heartbeat intervals of watching, nobody arriving
        spent = tally.snapshot() - before
        assert not watch.changed.is_set(), watch.reason
        assert sum(n for k, n in reads.items() if k.endswith(arrivals)) == 0, (reads, arrivals)
        assert spent["wait"] >= 5, spent  # it did watch, once per interval
        hs.append(RendezvousHandler(make(), fast("quiet", 2, 3), node_id="n2"))
        threads.append(join_in_background(hs[2]))
        assert watch.changed.wait(30), "an arrival for the next round wakes the watch"
        assert "round 2 opened" in (watch.reason or ""), watch.reason
    finally:
        end_joins(hs, threads, watch)

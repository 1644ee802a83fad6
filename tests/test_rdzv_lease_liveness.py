"""Liveness by lease on a real etcd: a node is alive while its key under its lease exists.

No heartbeat counter is written (1,024 counter bumps a second are Raft writes an etcd shared
with the nodes cannot sustain); a node whose lease runs out is lost, and its peers learn so
from a watch event, not by reading counters. A stranger without the token who deletes a
node's key or writes a leave mark into it evicts nobody: the lease still lives, and the node
puts its key back under it."""
from __future__ import annotations

import threading
import time
import uuid
from typing import Iterator

import pytest

from elastictk.rendezvous import MembershipWatch, RendezvousHandler, RoundInfo
from elastictk.rendezvous.liveness import ALIVE
from elastictk.store import EtcdStore
from tests.helpers.rdzvjoin import end_joins, join_in_background
from tests.test_rendezvous import fast, infos, join_all

TOKEN = "lease-token"


@pytest.fixture
def etcd(etcd_server: object) -> Iterator[tuple[str, str]]:
    yield etcd_server.endpoint, f"/lease-test-{uuid.uuid4().hex}/"  # type: ignore[attr-defined]


def test_a_node_whose_lease_expires_makes_its_peers_re_form(etcd: tuple[str, str]) -> None:
    endpoint, prefix = etcd
    raw = EtcdStore(endpoint, prefix=prefix, timeout=20)
    cfg = fast("lease", 2, 3, token=TOKEN, heartbeat_interval=0.2, heartbeat_timeout=2.0, join_timeout=60.0)
    hs = {n: RendezvousHandler(EtcdStore(endpoint, prefix=prefix, timeout=20), cfg, node_id=n) for n in "abc"}
    watches: list[MembershipWatch] = []
    try:
        first = infos(join_all(list(hs.values())))
        assert {i.world_size for i in first.values()} == {3}
        watches = [MembershipWatch(hs[n], first[n]) for n in "ab"]
        time.sleep(1.0)  # several beats: the keys stay as put, under a lease (no counter moves)
        (value, lease), = raw.leased_get(["rdzv/lease/hb/a"])[0]
        assert value == ALIVE and lease == hs["a"]._lease.id  # type: ignore[union-attr]
        # A stranger deletes b's key and writes a leave mark into a's: b's and a's leases live,
        # so nobody is lost, and each node puts its key back under its lease.
        raw.delete("rdzv/lease/hb/b")
        raw.set("rdzv/lease/hb/a", b"-1")
        assert not any(w.wait(3.0) for w in watches), [w.reason for w in watches]
        got = raw.leased_get(["rdzv/lease/hb/a", "rdzv/lease/hb/b"])[0]
        assert all(v == ALIVE and lease for v, lease in got), got
        # c dies without a word: its heartbeat stops, its lease is left to run out.
        hs["c"].close(leaving=False)
        for w in watches:
            assert w.wait(60), "the peers never noticed c's lease running out"
            assert w.lost == ["c"] and "lease expired" in (w.reason or ""), w.reason
            w.stop(wait=True)
        assert raw.try_get("rdzv/lease/hb/c") is None, "etcd deleted c's key with its lease"
        second = infos(join_all([hs["a"], hs["b"]]))
        assert {i.world_size for i in second.values()} == {2}
        assert {m.node_id for m in second["a"].members} == {"a", "b"}
    finally:
        for w in watches:
            w.stop(wait=True)
        for h in hs.values():
            h.close()
        raw.close()


def test_the_failure_watch_holds_one_stream_on_etcd(etcd: tuple[str, str]) -> None:
    """The failure watch asks each second whether ``failed`` appeared; on etcd one long-lived
    watch stream answers every ask (no request per second), and a failure still wakes it."""
    from elastictk.agent.coordination import RoundCoordinator
    endpoint, prefix = etcd
    h = RendezvousHandler(EtcdStore(endpoint, prefix=prefix, timeout=20), fast("fw", 1, 1, token=TOKEN), node_id="a")
    woken: list[bool] = []
    coord = None
    try:
        info = h.next_round()
        coord = RoundCoordinator(h.store, info.store, "a", on_failure=lambda: woken.append(True), signer=h.signer,
                                 where=(h.prefix, info.store_prefix))
        etcd_store = coord._watch_store
        while hasattr(etcd_store, "inner"):
            etcd_store = etcd_store.inner
        time.sleep(1.5)  # the watch is open
        before = etcd_store.requests  # type: ignore[attr-defined]
        time.sleep(4.0)  # four asks
        assert etcd_store.requests - before <= 1, "a request per ask"  # type: ignore[attr-defined]
        other = RoundCoordinator(h.store, info.store, "b", on_failure=lambda: None, signer=h.signer,
                                 where=(h.prefix, info.store_prefix))
        assert other.report_failure("node b: rank 1 exited with code 1")
        other.stop(wait=True)
        assert coord.failed.wait(30) and woken == [True]
    finally:
        if coord is not None:
            coord.stop(wait=True)
        h.close()


def test_a_watch_reads_the_next_rounds_arrivals_a_page_at_a_time(etcd: tuple[str, str]) -> None:
    """More strangers' arrivals than one page, then a node of the job: the watch reads on,
    page by page (never all N at once), and wakes for the job's node."""
    from elastictk.rendezvous.watch import ARRIVALS_PAGE
    endpoint, prefix = etcd
    raw = EtcdStore(endpoint, prefix=prefix, timeout=20)
    cfg = fast("page", 2, 3, token=TOKEN, join_timeout=60.0)
    hs = {n: RendezvousHandler(EtcdStore(endpoint, prefix=prefix, timeout=20), cfg, node_id=n) for n in "abc"}
    watch, t = None, None
    try:
        first = infos(join_all([hs["a"], hs["b"]]))
        watch = MembershipWatch(hs["a"], first["a"])
        for i in range(2 * ARRIVALS_PAGE + 1):  # unsigned: never wakes the job
            raw.set(f"rdzv/page/r/2/a/mallory{i}", b'{"node_id": "mallory"}')
        assert not watch.wait(1.5), watch.reason
        t = join_in_background(hs["c"])  # stopped below, once the watch has seen c arrive
        assert watch.wait(30) and "node c arrived" in (watch.reason or ""), watch.reason
    finally:
        end_joins(hs.values(), [t], watch)
        raw.close()


def test_a_waiting_node_whose_lease_ran_out_arrives_again(etcd: tuple[str, str]) -> None:
    """A host that stalls past its lease while it waits for the round: etcd deletes its arrival
    with the lease. It arrives anew under the lease its heartbeat granted, and the round forms
    with it; before, it waited out its join timeout uncounted (1,024 simulated nodes on 2 cores
    were seen "still joining" this way)."""
    endpoint, prefix = etcd
    raw = EtcdStore(endpoint, prefix=prefix, timeout=20)
    cfg = fast("again", 3, 3, token=TOKEN, heartbeat_interval=0.2, heartbeat_timeout=2.0, join_timeout=20.0)
    hs = {n: RendezvousHandler(EtcdStore(endpoint, prefix=prefix, timeout=20), cfg, node_id=n) for n in "cab"}
    out: dict[str, object] = {}
    threads: list[threading.Thread] = []

    def start(n: str) -> None:
        t = join_in_background(hs[n], out)
        threads.append(t)
        deadline = time.monotonic() + 60
        while raw.try_get(f"rdzv/again/r/1/a/{n}") is None:  # arrived, and waiting
            assert time.monotonic() < deadline and t.is_alive(), out
            time.sleep(0.05)
    try:
        start("c")  # the first arrival closes the round
        start("a")  # a waits for its assignment
        lease = hs["a"]._lease
        assert lease is not None
        assert raw.revoke(lease.id)  # as if it ran out: etcd deletes a's arrival with it
        threads.append(join_in_background(hs["b"], out))
        for t in threads:
            t.join(60)
        assert all(isinstance(out.get(n), RoundInfo) for n in "cab"), out
        assert sorted(out[n].rank for n in "cab") == [0, 1, 2]  # type: ignore[union-attr]
    finally:
        end_joins(hs.values(), threads)
        for h in hs.values():
            h.store.close()
        raw.close()


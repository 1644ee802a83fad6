"""The rendezvous handler over a real TCPStore: threads for protocol scenarios, processes
where a node must die for real (SIGKILL stops its heartbeat thread mid-beat)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

from elastictk.rendezvous import (
    MembershipWatch, RendezvousClosed, RendezvousConfig, RendezvousHandler,
    RendezvousStateError, RendezvousTimeout, RoundInfo,
)
from elastictk.store import EtcdStore, FileStore, Store, TCPStore


def fast(job: str, lo: int, hi: int, **kw: float) -> RendezvousConfig:
    opts = dict(last_call=0.3, join_timeout=20.0, heartbeat_interval=0.1, heartbeat_timeout=1.0)
    opts.update(kw)
    return RendezvousConfig(job, lo, hi, **opts)


@pytest.fixture
def server() -> Iterator[TCPStore]:
    s = TCPStore.serve(timeout=20)
    yield s
    s.close()


@pytest.fixture(params=["tcp", "file", "etcd"])
def connect(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[object], Store]]:
    """A factory of independent connections to one store of each backend (one per node)."""
    opened: list[Store] = []
    if request.param == "tcp":
        srv = request.getfixturevalue("server")
        make: Callable[[], Store] = lambda: TCPStore.connect(f"127.0.0.1:{srv.port}", timeout=20)
    elif request.param == "file":
        make = lambda: FileStore(tmp_path / "store", timeout=20)
    else:
        etcd = request.getfixturevalue("etcd_server")
        prefix = f"/rdzv-test-{uuid.uuid4().hex}/"
        make = lambda: EtcdStore(etcd.endpoint, prefix=prefix, timeout=20)

    def factory(_unused: object = None) -> Store:
        store = make()
        opened.append(store)
        return store

    yield factory
    for st in opened:
        st.close()


def join_all(handlers: list[RendezvousHandler]) -> dict[str, RoundInfo | BaseException]:
    out: dict[str, RoundInfo | BaseException] = {}

    def run(h: RendezvousHandler) -> None:
        try:
            out[h.node_id] = h.next_round()
        except BaseException as e:  # noqa: BLE001 - handed to the asserting thread
            out[h.node_id] = e

    threads = [threading.Thread(target=run, args=(h,)) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def infos(out: dict[str, RoundInfo | BaseException]) -> dict[str, RoundInfo]:
    for v in out.values():
        if isinstance(v, BaseException):
            raise v
    return out  # type: ignore[return-value]


def test_all_nodes_agree_on_one_membership(connect: Callable[[object], Store]) -> None:
    hs = [RendezvousHandler(connect(), fast("agree", 5, 5), node_id=f"n{i}", meta={"i": i}) for i in range(5)]
    try:
        got = infos(join_all(hs))
        views = {tuple((m.node_id, m.rank) for m in i.members) for i in got.values()}
        assert len(views) == 1, "every member sees the same membership"
        assert sorted(i.rank for i in got.values()) == [0, 1, 2, 3, 4]
        assert {i.world_size for i in got.values()} == {5} and {i.round for i in got.values()} == {1}
        assert {m.meta["i"] for m in next(iter(got.values())).members} == set(range(5))
        r0 = got["n0"]
        r0.store.set("k", b"v")
        assert got["n3"].store.get("k", timeout=5) == b"v", "the round's store prefix is shared"
    finally:
        for h in hs:
            h.close()


def test_last_call_then_scale_up_keeps_ranks(connect: Callable[[object], Store]) -> None:
    cfg = fast("scale", 2, 3, last_call=0.3)
    a, b = (RendezvousHandler(connect(), cfg, node_id=n) for n in ("a", "b"))
    c = RendezvousHandler(connect(), cfg, node_id="c")
    try:
        first = infos(join_all([a, b]))
        assert {i.world_size for i in first.values()} == {2}
        watch = MembershipWatch(a, first["a"])
        joined: dict[str, RoundInfo | BaseException] = {}
        tc = threading.Thread(target=lambda: joined.update(join_all([c])))
        tc.start()
        assert watch.wait(10), "a waiting node is signalled, not polled for"
        assert "opened" in (watch.reason or "")
        assert a.num_nodes_waiting() >= 1
        watch.stop(wait=True)
        second = infos(join_all([a, b]))
        tc.join(30)
        second.update(infos(joined))
        assert {i.world_size for i in second.values()} == {3}
        assert second["a"].rank == first["a"].rank and second["b"].rank == first["b"].rank
        assert second["c"].rank == 2 and second["c"].round == first["a"].round + 1
    finally:
        for h in (a, b, c):
            h.close()


def test_join_timeout_is_one_clear_line(connect: Callable[[object], Store]) -> None:
    h = RendezvousHandler(connect(), fast("lonely", 2, 2, join_timeout=0.8), node_id="solo")
    try:
        start = time.monotonic()
        with pytest.raises(RendezvousTimeout) as e:
            h.next_round()
        assert time.monotonic() - start < 10
        assert "join timeout" in str(e.value) and "\n" not in str(e.value)
    finally:
        h.close()


def test_shutdown_tells_waiters_and_late_joiners(connect: Callable[[object], Store]) -> None:
    cfg = fast("done", 2, 2)
    waiter = RendezvousHandler(connect(), cfg, node_id="w")
    boss = RendezvousHandler(connect(), cfg, node_id="boss")
    try:
        out: dict[str, RoundInfo | BaseException] = {}
        t = threading.Thread(target=lambda: out.update(join_all([waiter])))
        t.start()
        time.sleep(0.3)
        boss.shutdown("finished ok")
        t.join(10)
        assert isinstance(out["w"], RendezvousClosed) and "finished ok" in str(out["w"])
        late = RendezvousHandler(connect(), cfg, node_id="late")
        start = time.monotonic()
        with pytest.raises(RendezvousClosed, match="has finished"):
            late.next_round()
        assert time.monotonic() - start < 5
        late.close()
    finally:
        waiter.close()
        boss.close()


def test_leaving_node_is_seen_at_once(connect: Callable[[object], Store]) -> None:
    cfg = fast("leave", 2, 2, heartbeat_timeout=30.0)
    a, b = (RendezvousHandler(connect(), cfg, node_id=n) for n in ("a", "b"))
    try:
        got = infos(join_all([a, b]))
        watch = MembershipWatch(a, got["a"])
        b.close(leaving=True)
        start = time.monotonic()
        assert watch.wait(10) and "lost" in (watch.reason or "")
        assert time.monotonic() - start < 5, "leaving does not wait for the heartbeat timeout"
        watch.stop(wait=True)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    "garbage,match",
    [(b"\x80\x04pickle", "not JSON"), (b'{"schema": "torch.rdzv/9"}', "foreign"), (b'{"schema": "elastictk.rdzv/1", "round": 1}', "malformed")],
)
def test_garbage_in_the_store_names_the_key(connect: Callable[[object], Store], garbage: bytes, match: str) -> None:
    raw = connect()
    raw.set("rdzv/bad/latest", b"1")
    raw.set("rdzv/bad/r/1/result", garbage)
    h = RendezvousHandler(connect(), fast("bad", 1, 1), node_id="x")
    try:
        with pytest.raises(RendezvousStateError, match=match) as e:
            h.next_round()
        assert "rdzv/bad/r/1/result" in str(e.value) and "\n" not in str(e.value)
    finally:
        h.close()


class Node:
    """A rendezvous node in its own process."""

    def __init__(self, port: int, job: str, node_id: str, lo: int, hi: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.rdzv_node", f"127.0.0.1:{port}", job, node_id, str(lo), str(hi)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        assert json.loads(self.readline())["ready"] == node_id

    def readline(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def join(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("join\n")
        self.proc.stdin.flush()

    def result(self) -> dict:
        return json.loads(self.readline())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f:
                f.close()


def test_sigkilled_node_is_detected_and_the_rest_continue(server: TCPStore) -> None:
    nodes = [Node(server.port, "kill", f"p{i}", 2, 3) for i in range(3)]
    try:
        for n in nodes:
            n.join()
        first = [n.result() for n in nodes]
        assert {r["world"] for r in first} == {3}, first
        victim = next(n for n, r in zip(nodes, first) if r["rank"] == 1)
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        survivors = [n for n in nodes if n is not victim]
        start = time.monotonic()
        for n in survivors:
            n.join()
        second = [n.result() for n in survivors]
        assert {r["world"] for r in second} == {2}, second
        assert sorted(r["rank"] for r in second) == [0, 1]
        assert time.monotonic() - start < 15, "the dead node is dropped after its heartbeat timeout"
        before = {r["members"][r["rank"]]: r["rank"] for r in first}
        for r in second:
            me = r["members"][r["rank"]]
            if before[me] < 2:
                assert r["rank"] == before[me]
    finally:
        for n in nodes:
            n.stop()

"""Sealed records (issue #17): a forged, garbled or replayed record in any key the nodes act
on is absent. Real handlers and coordinators over each real store (c10d TCPStore, FileStore,
etcd), with a stranger that writes straight into the store without the token."""
from __future__ import annotations

import json
import threading
import time
from typing import Callable

import pytest

from elastictk.agent.coordination import Decision, RoundCoordinator, agree_master, restart_count
from elastictk.agent.inplace_host import HOST_KEY, STORE_KEY, InPlaceHost, Setup, started_key
from elastictk.agent.policy import RestartPolicy
from elastictk.inplace.protocol import Generation
from elastictk.rendezvous import RendezvousHandler, RoundInfo
from elastictk.rendezvous.records import Member, RoundResult
from elastictk.store import Store
from tests import test_rendezvous as _rdzv
from tests.test_rendezvous import fast, infos, join_all

connect_store = _rdzv.connect  # fixtures: one store of each backend (tcp, file, etcd)
server = _rdzv.server

TOKEN = "s3cret-token"
FORGED_NOTE = json.dumps({"node_id": "mallory", "headline": "forged"}).encode()


def coordinators(hs: list[RendezvousHandler], rounds: dict[str, RoundInfo],
                 woken: dict[str, threading.Event]) -> dict[str, RoundCoordinator]:
    return {h.node_id: RoundCoordinator(h.store, rounds[h.node_id].store, h.node_id,
                                        on_failure=woken[h.node_id].set, signer=h.signer,
                                        where=(h.prefix, rounds[h.node_id].store_prefix))
            for h in hs}


def two_nodes(connect_store: Callable[[], Store], job: str) -> tuple[list[RendezvousHandler], dict[str, RoundInfo]]:
    hs = [RendezvousHandler(connect_store(), fast(job, 2, 2, token=TOKEN), node_id=n) for n in "ab"]
    return hs, infos(join_all(hs))


@pytest.mark.parametrize("forged", [FORGED_NOTE, b"\x80garbage"])
def test_a_forged_failure_note_neither_stops_the_watch_nor_wins(connect_store: Callable[[], Store], forged: bytes) -> None:
    hs, rounds = two_nodes(connect_store, "failwatch")
    raw = connect_store()
    woken = {n: threading.Event() for n in "ab"}
    coords = coordinators(hs, rounds, woken)
    try:
        raw.set(f"{rounds['a'].store_prefix}/failed", forged)
        time.sleep(2.0)  # each watch sees the key within its 1 s wait
        assert not any(e.is_set() for e in woken.values()), "a stranger's note is no failure"
        assert coords["b"].report_failure("node b: rank 1 exited with code 1"), \
            "the real failure wins the compare-and-set over the forged bytes"
        assert woken["a"].wait(10), "a's failure watch is still alive and sees b's failure"
        note = coords["a"].failure_note()
        assert note is not None and note.node_id == "b"
        decision = coords["b"].decide(RestartPolicy(max_restarts=3), "boom")
        assert decision is not None and decision.restart_count == 1
        got = coords["a"].await_decision(10)
        assert got == decision
    finally:
        for c in coords.values():
            c.stop(wait=True)
        for h in hs:
            h.close()


@pytest.mark.parametrize("mark", [json.dumps({"node_id": "b"}).encode(), b"\x80garbage"])
def test_a_forged_failure_does_not_restart_a_finished_job(connect_store: Callable[[], Store], mark: bytes) -> None:
    """The exit barrier reads each member's own sealed ``finished/<node>`` mark: b's mark forged
    (unsigned, or garbage) does not let a leave before b finishes."""
    hs, rounds = two_nodes(connect_store, "barrier")
    raw = connect_store()
    woken = {n: threading.Event() for n in "ab"}
    coords = coordinators(hs, rounds, woken)
    out: dict[str, bool] = {}
    try:
        raw.set(f"{rounds['a'].store_prefix}/failed", FORGED_NOTE)
        raw.set(f"{rounds['a'].store_prefix}/all_finished", b"1")  # the old barrier's flag, forged
        raw.set(f"{rounds['a'].store_prefix}/finished/b", mark)  # b's own mark, forged
        t = threading.Thread(target=lambda: out.update(a=coords["a"].exit_barrier(2, 20, members=["a", "b"])))
        t.start()
        time.sleep(1.0)
        assert t.is_alive(), "a forged barrier mark does not let a node leave before its peers"
        out["b"] = coords["b"].exit_barrier(2, 20, members=["a", "b"])
        t.join(30)
        assert out == {"a": True, "b": True}, "both finished: the forged failure note restarts nothing"
    finally:
        for c in coords.values():
            c.stop(wait=True)
        for h in hs:
            h.close()


def test_no_decision_is_charged_exactly_once_not_forgiven(connect_store: Callable[[], Store]) -> None:
    hs = [RendezvousHandler(connect_store(), fast("orphan", 3, 3, token=TOKEN), node_id=n) for n in "abc"]
    rounds = infos(join_all(hs))
    woken = {n: threading.Event() for n in "abc"}
    coords = coordinators(hs, rounds, woken)
    policy = RestartPolicy(max_restarts=5)
    try:
        assert coords["a"].report_failure("node a: rank 0 exited")  # a fails first, then dies undecided
        assert coords["b"].await_decision(0.5) is None and coords["c"].await_decision(0.5) is None
        got: dict[str, object] = {}
        ts = [threading.Thread(target=lambda n=n: got.update({n: coords[n].take_over(policy, "no decision", 10)}))
              for n in "bc"]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert got["b"] == got["c"], "both survivors follow one decision"
        assert restart_count(hs[1].store, hs[1].signer, hs[1].prefix) == 1, "charged once, not zero times"
    finally:
        for c in coords.values():
            c.stop(wait=True)
        for h in hs:
            h.close()


def test_records_of_an_earlier_run_are_not_believed_in_a_later_one(connect_store: Callable[[], Store]) -> None:
    raw = connect_store()
    h = RendezvousHandler(connect_store(), fast("replay", 1, 1, token=TOKEN), node_id="a")
    info = h.next_round()
    coord = RoundCoordinator(h.store, info.store, "a", on_failure=lambda: None, signer=h.signer,
                             where=(h.prefix, info.store_prefix))
    coord.report_failure("boom")
    coord.decide(RestartPolicy(max_restarts=5), "boom")
    coord.stop(wait=True)
    h.shutdown("finished")
    h.close()
    captured = {k: raw.try_get(k) for k in ("rdzv/replay/shutdown", "rdzv/replay/policy")}
    assert all(v is not None for v in captured.values())
    for k in raw.keys("rdzv/replay/"):  # the store is cleared; a new run with the same id and token
        raw.delete(k)
    h2 = RendezvousHandler(connect_store(), fast("replay", 1, 1, token=TOKEN), node_id="b")
    try:
        h2.start_heartbeat()
        h2._admit()
        for k, v in captured.items():
            assert v is not None
            raw.set(k, v)  # replayed into the new run
        info2 = h2.next_round()  # the captured shutdown does not close the new run
        assert info2.round == 1
        assert restart_count(h2.store, h2.signer, h2.prefix) == 0, "the old run's budget is not this run's"
    finally:
        h2.close()


def test_a_forged_master_address_is_never_handed_to_workers(connect_store: Callable[[], Store]) -> None:
    hs, rounds = two_nodes(connect_store, "master")
    raw = connect_store()
    try:
        a, b = (rounds[n] for n in "ab")
        r0, r1 = (a, b) if a.rank == 0 else (b, a)
        h0, h1 = (hs[0], hs[1]) if a.rank == 0 else (hs[1], hs[0])
        raw.set(f"{r1.store_prefix}/master", b"10.6.6.6 6666")
        raw.set(f"{r1.store_prefix}/master", json.dumps({"addr": "10.6.6.6", "port": 6666}).encode())
        got: dict[str, tuple[str, int]] = {}
        t = threading.Thread(target=lambda: got.update(
            r1=agree_master(r1, "127.0.0.1", 20, h1.records.view(r1.store, r1.store_prefix))))
        t.start()
        time.sleep(1.0)
        mine = agree_master(r0, "127.0.0.1", 20, h0.records.view(r0.store, r0.store_prefix))
        t.join(30)
        assert got["r1"] == mine and mine[0] == "127.0.0.1"
    finally:
        for h in hs:
            h.close()


def test_a_flood_of_arrivals_sizes_nothing(connect_store: Callable[[], Store]) -> None:
    raw = connect_store()
    h = RendezvousHandler(connect_store(), fast("flood", 1, 2, token=TOKEN, last_call=0.2), node_id="a")
    try:
        raw.set("rdzv/flood/r/1/arrivals", b"1000000000")  # a stranger's counter: a billion slots
        raw.set("rdzv/flood/r/2/arrivals", b"-5")
        t0 = time.monotonic()
        assert h.num_nodes_waiting() <= 2
        h2 = RendezvousHandler(connect_store(), fast("flood", 1, 2, token=TOKEN, join_timeout=2.0), node_id="b")
        try:
            if raw.ordered_arrivals:  # etcd orders arrivals itself: the forged counter is never read
                assert h2.next_round().world_size == 1
            else:
                with pytest.raises(Exception):  # noqa: B017 - past the cap: this node never closes; it times out
                    h2.next_round()
        finally:
            h2.close()
        assert time.monotonic() - t0 < 20, "no read sized by the forged counter"
    finally:
        h.close()


def nodes_with(connect_store: Callable[[], Store], job: str, token: str | None,
               ids: str = "ab") -> tuple[list[RendezvousHandler], dict[str, RoundInfo]]:
    hs = [RendezvousHandler(connect_store(), fast(job, len(ids), len(ids), token=token), node_id=n) for n in ids]
    return hs, infos(join_all(hs))


def agree_inplace(host: InPlaceHost, h: RendezvousHandler, info: RoundInfo, keep: bool = False,
                  joining: tuple[str, ...] = (), start_timeout: float = 5.0) -> Setup:
    return host.agree(h.records, info, keep=keep, fresh_prefix=f"fresh/{h.node_id}/{info.round}",
                      first=Generation(0, info.world_size), joining=list(joining), timeout=20,
                      start_timeout=start_timeout)


@pytest.mark.parametrize("token", [TOKEN, None])
def test_forged_inplace_host_and_setup_records_are_not_followed(connect_store: Callable[[], Store],
                                                               token: str | None) -> None:
    """A stranger names a member as the in-place store's host and writes a setup pointing the
    workers at its own endpoint: with a token both are waited past (group rank 0 hosts, every
    agent gets its endpoint); without one, the same writes are believed (the failing side)."""
    hs, rounds = nodes_with(connect_store, "ipforge" + ("t" if token else "n"), token)
    raw = connect_store()
    hosts = {h.node_id: InPlaceHost("127.0.0.1", h.node_id) for h in hs}
    try:
        by_rank = sorted(hs, key=lambda h: rounds[h.node_id].rank)
        h0, h1 = by_rank
        info1 = rounds[h1.node_id]
        raw.set(f"{h0.prefix}/{HOST_KEY}", json.dumps({"node_id": h1.node_id}).encode())
        evil = {"endpoint": "127.0.0.1:9", "prefix": "evil", "gen": 0, "keep": False}
        raw.set(f"{info1.store_prefix}/{STORE_KEY}", json.dumps(evil).encode())
        got: dict[str, Setup | BaseException] = {}

        def run(h: RendezvousHandler) -> None:
            try:
                got[h.node_id] = agree_inplace(hosts[h.node_id], h, rounds[h.node_id])
            except BaseException as e:  # noqa: BLE001 - handed to the asserting thread
                got[h.node_id] = e

        threads = [threading.Thread(target=run, args=(h,)) for h in (h1, h0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        s0, s1 = got[h0.node_id], got[h1.node_id]
        if token:
            assert isinstance(s0, Setup) and isinstance(s1, Setup), got
            assert s0.endpoint != "127.0.0.1:9" and s1 == s0, "both follow group rank 0's real store"
            assert h0.records.read(HOST_KEY) == {"node_id": h0.node_id}
            assert b'"mac"' in (raw.try_get(f"{h0.prefix}/{HOST_KEY}") or b""), "the forged host was replaced"
        else:
            assert isinstance(s1, Setup) and s1.endpoint == "127.0.0.1:9", got
    finally:
        for x in hosts.values():
            x.close()
        for h in hs:
            h.close()
        raw.close()


def test_a_forged_started_mark_does_not_make_the_host_publish_early(connect_store: Callable[[], Store]) -> None:
    """When a node joins in place, the host publishes the new generation once the joiner's
    agent says its workers started; a stranger's unsealed mark is waited past: the generation
    appears only after the real (sealed) mark."""
    hs, rounds = nodes_with(connect_store, "started", TOKEN, ids="a")
    (h,) = hs
    info = rounds["a"]
    host = InPlaceHost("127.0.0.1", "a")
    raw = connect_store()
    try:
        first = agree_inplace(host, h, info)
        raw.set(f"{info.store_prefix}/{started_key('c')}", json.dumps({"node_id": "c"}).encode())
        real_written = threading.Event()

        def real_mark() -> None:
            time.sleep(1.0)
            real_written.set()
            h.records.view(info.store, info.store_prefix).write(started_key("c"), {"node_id": "c"})

        t = threading.Thread(target=real_mark)
        t.start()
        setup = agree_inplace(host, h, info, keep=True, joining=("c",), start_timeout=30)
        published_after_real = real_written.is_set()
        t.join(10)
        assert setup.keep and setup.prefix == first.prefix and setup.gen == 1
        assert published_after_real, "the forged mark made the host publish before the joiner started"
    finally:
        host.close()
        h.close()
        raw.close()


@pytest.mark.parametrize("token", [TOKEN, None])
def test_a_forged_decider_does_not_take_the_decision(connect_store: Callable[[], Store], token: str | None) -> None:
    """A stranger claims the round's ``decider`` before a real failure: with a token the node
    whose worker failed still wins the compare-and-set and charges it; without one, the
    stranger's claim stands (the failing side)."""
    hs, rounds = nodes_with(connect_store, "decider" + ("t" if token else "n"), token, ids="a")
    (h,) = hs
    raw = connect_store()
    coord = RoundCoordinator(h.store, rounds["a"].store, "a", on_failure=lambda: None, signer=h.signer,
                             where=(h.prefix, rounds["a"].store_prefix))
    try:
        raw.set(f"{rounds['a'].store_prefix}/decider", json.dumps({"node_id": "mallory"}).encode())
        won, holder = coord.records.claim("decider", {"node_id": "a"})
        if token:
            assert won and holder["node_id"] == "a"
            coord.records.store.delete("decider")  # as before the failure: decide claims it itself
            raw.set(f"{rounds['a'].store_prefix}/decider", json.dumps({"node_id": "mallory"}).encode())
            assert coord.decide(RestartPolicy(max_restarts=3), "boom") == Decision("restart", 1, "boom")
            assert restart_count(h.store, h.signer, h.prefix) == 1
        else:
            assert not won and holder["node_id"] == "mallory"
    finally:
        coord.stop(wait=True)
        h.close()
        raw.close()


@pytest.mark.parametrize("token", [TOKEN, None])
def test_a_forged_round_result_is_not_believed(connect_store: Callable[[], Store], token: str | None) -> None:
    """A well-formed but unsigned result for the round the nodes are about to close, naming a
    stranger as its only member: with a token the closer replaces it and the real members get
    the round; without one the nodes believe it (the failing side: the stranger is a member or
    the nodes are sent on to another round)."""
    job = "result" + ("t" if token else "n")
    raw = connect_store()
    forged = RoundResult(1, (Member("mallory", 0, {}),)).to_json()
    raw.set(f"rdzv/{job}/r/1/result", forged)
    hs = [RendezvousHandler(connect_store(), fast(job, 2, 2, token=token, join_timeout=8.0), node_id=n) for n in "ab"]
    try:
        out = join_all(hs)
        if token:
            got = infos(out)
            assert {m.node_id for m in got["a"].members} == {"a", "b"} and got["a"].round == 1
            assert got["a"].members == got["b"].members
        else:
            assert any(isinstance(v, BaseException) or v.round != 1 or "mallory" in {m.node_id for m in v.members}
                       for v in out.values()), out
    finally:
        for h in hs:
            h.close()
        raw.close()

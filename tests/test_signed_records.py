"""Sealed records (issue #17): a forged, garbled or replayed record in any key the nodes act
on is absent. Real handlers and coordinators over each real store (c10d TCPStore, FileStore,
etcd), with a stranger that writes straight into the store without the token."""
from __future__ import annotations

import json
import threading
import time
from typing import Callable

import pytest

from elastictk.agent.coordination import RoundCoordinator, agree_master, restart_count
from elastictk.agent.policy import RestartPolicy
from elastictk.rendezvous import RendezvousHandler, RoundInfo
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
        with pytest.raises(Exception):  # noqa: B017 - past the cap: this node never closes; it times out
            h2 = RendezvousHandler(connect_store(), fast("flood", 1, 2, token=TOKEN, join_timeout=2.0), node_id="b")
            try:
                h2.next_round()
            finally:
                h2.close()
        assert time.monotonic() - t0 < 20, "no read sized by the forged counter"
    finally:
        h.close()

"""A slot being shipped is pinned, so replicas arrive whole when sends are slower than the steps,
and how far each rank's replica lags is a metric and a line (snapshot/local.py, peertier.py,
lag.py)."""
from __future__ import annotations

import logging
import os
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastictk.snapshot.codec import checksum
from elastictk.snapshot.lag import LagCollector, ReplicaLag, next_report
from elastictk.snapshot.local import READY, Holder, Region
from elastictk.snapshot.peertier import PeerTier
from elastictk.snapshot.settings import ENV_NOTIFY

JOB, TOKEN = "pin-test", "pin-token"


class Member:
    def __init__(self, node_id: str, rank: int, meta: dict[str, object]) -> None:
        self.node_id, self.rank, self.meta = node_id, rank, meta


def _commit(region: Region, step: int, payload: bytes, rank: int = 1, world: int = 2) -> None:
    i = region.begin()
    region.data(i)[:len(payload)] = payload
    region.publish(i, step, len(payload), rank, world)
    region.seal(i)


def _part(step: int, size: int) -> bytes:
    return step.to_bytes(4, "little") * (size // 4)



def _pair(tiers: list[PeerTier], holders: list[Holder]) -> Region:
    """Nodes 0 and 1 in one round of two (node 1's parts replicate to node 0), and rank 0's
    worker region on node 1."""
    members = [Member(f"node{i}", i, {"addr": "127.0.0.1", **tiers[i].meta()}) for i in range(2)]
    for i in range(2):
        tiers[i].round(members, 2, f"node{i}", i, prefetch=False)
    return Region(holders[1].path, 0, holders[1].region, holders[1].memory, 1,
                  notify=tiers[1].env()[ENV_NOTIFY])


def _close(worker: Region | None, tiers: list[PeerTier], holders: list[Holder]) -> None:
    if worker is not None:
        worker.close()
    for t in tiers:
        t.close()
    for h in holders:
        h.close()

def test_a_pinned_slot_is_never_written_and_commits_go_to_the_other_one() -> None:
    with Holder(1, 1 << 20) as h:
        r = Region(h.path, 0, h.region, h.memory, 1)
        try:
            _commit(r, 1, _part(1, 4096))
            first = r.meta(r.active)
            assert r.pin(first) and r.pinned == first.index
            for step in range(2, 6):  # the worker keeps committing while the agent ships step 1
                _commit(r, step, _part(step, 4096))
                assert bytes(r.data(first.index)[:4096]) == _part(1, 4096), f"pinned slot written at {step}"
                assert [m.step for m in r.ready(1, 2)] == [step, 1]
            assert r.verify(r.meta(first.index)) is None, "the pinned part is whole"
            r.unpin()
            _commit(r, 6, _part(6, 4096))
            assert sorted(m.step for m in r.ready(1, 2)) == [5, 6], "unpinned: the slots alternate again"
        finally:
            r.close()


def test_a_slot_overwritten_before_the_pin_is_not_pinned() -> None:
    with Holder(1, 1 << 20) as h:
        r = Region(h.path, 0, h.region, h.memory, 1)
        try:
            _commit(r, 1, _part(1, 4096))
            seen = r.meta(r.active)
            _commit(r, 2, _part(2, 4096))
            _commit(r, 3, _part(3, 4096))  # the slot the agent read is step 3 now
            assert not r.pin(seen) and r.pinned == -1
        finally:
            r.close()


@given(st.integers(0, 1000), st.integers(0, 1000), st.integers(1, 64))
def test_the_lag_line_is_said_past_the_bound_each_doubling_and_once_back(reported: int, lag: int,
                                                                          bound: int) -> None:
    new, what = next_report(reported, lag, bound)
    if lag > bound:
        assert (what == "over") == (reported == 0 or lag >= 2 * reported)
        assert new == (lag if what == "over" else reported)
    else:
        assert what == ("back" if reported else None) and new == 0


def test_the_lag_gauge_and_line() -> None:
    lag = ReplicaLag(bound=3)
    lag.sealed(0, 5, 1)
    lag.replicated(0, 1, 0.1)
    lag.sealed(0, 5, 9)
    samples = [s for m in LagCollector(lag).collect() for s in m.samples]
    assert [(s.name, s.labels, s.value) for s in samples] == [
        ("elastictk_snapshot_replica_lag_steps", {"rank": "5"}, 8)]


def test_sends_slower_than_the_steps_deliver_whole_replicas_and_the_lag_is_said(
        caplog: pytest.LogCaptureFixture) -> None:
    """Node 1 commits every few milliseconds while each send to node 0 takes ~0.15 s: before the
    pin every part was overwritten while it was sent and refused torn, so node 0 never held one."""
    size = 64 << 10
    holders = [Holder(1, 4 << 20) for _ in range(2)]
    os.environ["ELASTICTK_SNAPSHOT_TEST_SEND_BPS"] = str(size / 0.15)
    try:
        tiers = [PeerTier(h, "127.0.0.1", TOKEN, JOB, 1, 4 << 20) for h in holders]
    finally:
        del os.environ["ELASTICTK_SNAPSHOT_TEST_SEND_BPS"]
    tiers[1].lag.bound = 3
    worker = None
    try:
        worker = _pair(tiers, holders)
        kept: list[int] = []
        step = 0
        caplog.set_level(logging.INFO, logger="elastictk.snapshot")
        deadline = time.monotonic() + 120
        while len(set(kept)) < 3:  # three whole replicas, each sent while ~dozens of commits landed
            assert time.monotonic() < deadline, f"replicas kept: {kept}; log: {caplog.text[-2000:]}"
            step += 1
            _commit(worker, step, _part(step, size))
            time.sleep(0.005)
            kept += [k.step for k in tiers[0].replicas.index()]
        assert "torn" not in caplog.text, caplog.text[-2000:]
        rep = tiers[0].replicas.borrow(1, 2, max(kept))
        assert rep is not None
        try:
            assert bytes(rep.data()) == _part(rep.key.step, size) and checksum(rep.data()) == rep.digest
        finally:
            tiers[0].replicas.give_back(rep)
        assert max(kept) < step - 3, "the replica lags: several commits landed during each send"
        assert "rank 1's replica lags" in caplog.text and "behind its newest commit" in caplog.text
        assert tiers[1].lag.lags()[1] > 0
        states = [worker.meta(i).state for i in (0, 1)]
        assert READY in states
    finally:
        _close(worker, tiers, holders)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("elastictk-replicator")]


def test_a_connection_the_receiver_closed_while_idle_is_made_anew_and_the_part_still_arrives(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Between commits (a long eval, a slow step) the receiving server closes an idle sender's
    connection; the next put on it found it closed and the part was not replicated (a send lost,
    the replica one more send behind). Now the sender connects anew once and the part arrives."""
    from elastictk.snapshot import peer

    monkeypatch.setattr(peer, "TIMEOUT", 0.3)  # the server's idle limit, 60 s in a job
    holders = [Holder(1, 1 << 20) for _ in range(2)]
    tiers = [PeerTier(h, "127.0.0.1", TOKEN, JOB, 1, 1 << 20) for h in holders]
    worker = None
    caplog.set_level(logging.INFO, logger="elastictk.snapshot")

    def wait(cond: object, what: str) -> None:
        deadline = time.monotonic() + 60
        while not cond():  # type: ignore[operator]
            assert time.monotonic() < deadline, f"{what}; log: {caplog.text[-2000:]}"
            time.sleep(0.01)

    try:
        worker = _pair(tiers, holders)
        _commit(worker, 1, _part(1, 4096))
        wait(lambda: [k.step for k in tiers[0].replicas.index()] == [1], "step 1 never arrived")
        wait(lambda: tiers[0].server.connections()[1] == 0, "the idle connection was never closed")
        _commit(worker, 2, _part(2, 4096))
        wait(lambda: [k.step for k in tiers[0].replicas.index()] == [2], "step 2 never arrived")
        assert "not replicated" not in caplog.text, caplog.text[-2000:]
        assert tiers[0].server.whole == 2 and tiers[0].server.torn == 0
    finally:
        _close(worker, tiers, holders)


def test_a_round_resumed_at_a_late_step_lags_by_what_it_sealed_since_not_by_its_step_number(
        caplog: pytest.LogCaptureFixture) -> None:
    """After a restore at step 100 the new round's neighbours hold nothing yet: the first seal
    lags 1 step (before: 101, and a line that a lost node would resume 101 steps back)."""
    caplog.set_level(logging.INFO, logger="elastictk.snapshot")
    lag = ReplicaLag(bound=8)
    lag.sealed(0, 3, 100)
    assert lag.lags() == {3: 1} and "lags" not in caplog.text
    for step in range(101, 110):
        lag.sealed(0, 3, step)
    assert lag.lags() == {3: 10} and "rank 3's replica lags 9 steps" in caplog.text  # past 8: said once
    lag.replicated(0, 108, 0.5)
    assert lag.lags() == {3: 1}
    lag.sealed(0, 4, 7)  # the slot now holds another rank's parts: its own count
    assert lag.lags() == {4: 1}

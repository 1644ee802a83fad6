"""Watch threads never die silently (issue #17): garbage in every key the membership watch and
the failure watch read, with and without a token, on each real store."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import pytest

from elastictk.agent.coordination import RoundCoordinator
from elastictk.rendezvous import MembershipWatch, RendezvousHandler
from elastictk.store import Store
from tests import test_rendezvous as _rdzv
from tests.test_rendezvous import fast, infos, join_all

connect_store = _rdzv.connect  # fixtures: one store of each backend (tcp, file, etcd)
server = _rdzv.server

GARBAGE = [b"\x80\x04\x95pickle", b"not a number", b"-7", b"99999999999999999999999999", b"{}", b"[1, 2]", b""]


@pytest.mark.parametrize("token", [None, "s3cret-token"])
def test_garbage_in_every_watched_key_kills_no_watch(connect_store: Callable[[], Store], token: str | None) -> None:
    hs = [RendezvousHandler(connect_store(), fast("garbage", 2, 3, token=token), node_id=n) for n in "ab"]
    raw = connect_store()
    rounds = infos(join_all(hs))
    a = hs[0]
    info = rounds["a"]
    woken = threading.Event()
    watch = MembershipWatch(a, info)
    coord = RoundCoordinator(a.store, info.store, "a", on_failure=woken.set, signer=a.signer,
                             where=(a.prefix, info.store_prefix))
    threads = [t for t in threading.enumerate() if t.name.startswith(("elastictk-watch", "elastictk-failure"))]
    try:
        for value in GARBAGE:
            raw.set("rdzv/garbage/r/2/arrivals", value)
            raw.set("rdzv/garbage/r/2/slot/1", value)
            raw.set("rdzv/garbage/left/b", value)
            raw.set("rdzv/garbage/lost/b", value)
            if token is not None:  # without a token a note is believed as is, as in torchrun
                raw.set("rdzv/garbage/shutdown", value)
                raw.set(f"{info.store_prefix}/failed", value)
            time.sleep(0.4)
            assert all(t.is_alive() for t in threads) or watch.changed.is_set(), f"a watch died on {value!r}"
        if token is not None:
            assert not watch.changed.is_set(), f"garbage changed the membership: {watch.reason}"
            assert not woken.is_set(), "garbage is no failure"
            assert all(t.is_alive() for t in threads)
        else:
            # Without a token: anything may be believed, but nothing dies silently: either
            # still watching, or it said why (a reason the agent acts on).
            assert all(t.is_alive() for t in threads) or watch.reason
        if not watch.changed.is_set() and raw.lease_liveness:
            # On etcd b's liveness is its lease: garbage a stranger writes into its key is no
            # loss (the lease lives), and b puts its key back under its lease.
            raw.set("rdzv/garbage/hb/b", b"\x80 not a counter")
            assert not watch.wait(2.0), watch.reason
            deadline = time.monotonic() + 30
            while raw.leased_get(["rdzv/garbage/hb/b"])[0][0][1] == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert raw.leased_get(["rdzv/garbage/hb/b"])[0][0][1] != 0, "b never put its key back"
        elif not watch.changed.is_set():
            # A heartbeat counter that is not a number: b reads as silent (lost after the
            # timeout, a reason the agent acts on), never a dead watch thread.
            raw.set("rdzv/garbage/hb/b", b"\x80 not a counter")
            assert watch.wait(10) and watch.reason and "lost" in watch.reason, watch.reason
            assert watch.store_error is None
    finally:
        watch.stop(wait=True)
        coord.stop(wait=True)
        for h in hs:
            h.close()


def test_an_unexpected_error_in_a_watch_is_logged_and_wakes_the_agent(
        connect_store: Callable[[], Store], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    hs = [RendezvousHandler(connect_store(), fast("boom", 1, 1, token="t"), node_id="a")]
    info = infos(join_all(hs))["a"]
    h = hs[0]
    woken = threading.Event()
    errors: list[BaseException] = []

    def broken(*_a: object, **_k: object) -> None:
        raise ZeroDivisionError("a bug")

    from elastictk.rendezvous.sealed import Follower

    monkeypatch.setattr(Follower, "wait", broken)  # the failure watch's next wait raises
    coord = RoundCoordinator(h.store, info.store, "a", on_failure=lambda: None, signer=h.signer,
                             where=(h.prefix, info.store_prefix),
                             on_error=lambda e: (errors.append(e), woken.set()))
    watch = MembershipWatch(h, info)
    watch._poll = broken  # type: ignore[method-assign]
    try:
        assert woken.wait(10), "the failure watch woke the agent"
        assert isinstance(errors[0], ZeroDivisionError) and coord.watch_error is errors[0]
        assert watch.wait(15), "the membership watch signals after riding through heartbeat_timeout"
        assert watch.store_error is not None and "ZeroDivisionError" in str(watch.store_error)
        assert "ZeroDivisionError" in caplog.text
    finally:
        watch.stop(wait=True)
        coord.stop(wait=True)
        h.close()


def test_a_store_briefly_unreachable_is_ridden_through_not_lost(
        connect_store: Callable[[], Store], monkeypatch: pytest.MonkeyPatch) -> None:
    """An etcd leader election or a slow failover is not a lost store: the membership watch
    retries until heartbeat_timeout and says nothing while the store answers again in time."""
    from elastictk.store import StoreUnreachable

    hs = [RendezvousHandler(connect_store(), fast("blip", 1, 1, token="t"), node_id="a")]
    info = infos(join_all(hs))["a"]
    h = hs[0]
    watch = MembershipWatch(h, info)
    store = watch._store
    # on etcd the watch holds streams (the next round's arrivals, the successors' leases) and
    # makes no request while nothing happens: fail its per-interval look at the successors
    failures = {"left": 3}
    if store.lease_liveness:
        from elastictk.rendezvous.leasering import LeaseRing
        target: Any = LeaseRing
        name = "lost"
    else:
        target, name = store, "wait"
    real_wait = getattr(target, name)

    def flaky_wait(*args: Any) -> Any:
        if failures["left"] > 0:
            failures["left"] -= 1
            raise StoreUnreachable("cannot reach etcd (a member is electing a leader)")
        return real_wait(*args)

    monkeypatch.setattr(target, name, flaky_wait)
    try:
        deadline = time.monotonic() + 10
        while failures["left"] > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failures["left"] == 0, "the watch did not retry the store"
        time.sleep(1.0)
        assert not watch.changed.is_set(), f"a brief outage ended the round: {watch.reason}"
        assert watch.store_error is None
    finally:
        watch.stop(wait=True)
        h.close()

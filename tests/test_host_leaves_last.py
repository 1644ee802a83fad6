"""The node hosting a c10d store, ending a failed job, leaves after the others.

Its store goes with its process: a peer that had not yet read why the job ended (a flag that
differs between the nodes, the decision to give up) found the store gone and ended with "store
lost" instead of the job's own line (seen on a loaded host in test_shared_flags). Real TCPStore,
real handlers heartbeating; what is judged is the order of events, not a time."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any, Iterator, cast

import pytest

from elastictk.agent.config import AgentConfig
from elastictk.agent.ending import host_leaves_last
from elastictk.agent.outcome import AgentResult, ResultState
from elastictk.rendezvous import RendezvousHandler
from elastictk.store import TCPStore
from tests.test_rendezvous import fast, infos, join_all


@pytest.fixture
def server() -> Iterator[TCPStore]:
    s = TCPStore.serve(timeout=20)
    yield s
    s.close()


def _job(server: TCPStore, job: str, timeout: float) -> tuple[list[RendezvousHandler], Any]:
    hs = [RendezvousHandler(TCPStore.connect(f"127.0.0.1:{server.port}", timeout=20),
                            fast(job, 3, 3, heartbeat_timeout=timeout), node_id=n) for n in "abc"]
    return hs, infos(join_all(hs))["a"]


def _ending(a: RendezvousHandler, info: Any, hosts: bool, state: ResultState, order: list[str]) -> threading.Thread:
    cfg = cast(AgentConfig, SimpleNamespace(hosts_store=hosts, rdzv=a.config))
    result = AgentResult(state, 1 if state == ResultState.FAILED else 0, "failed: out of restarts")

    def run() -> None:
        host_leaves_last(a, cfg, info, result)
        order.append("host gone")

    t = threading.Thread(target=run)
    t.start()
    return t


def _close(hs: list[RendezvousHandler]) -> None:
    for h in hs:
        h.close(leaving=True)
        h.store.close()


def test_a_failed_store_host_waits_until_every_peer_has_left(server: TCPStore) -> None:
    hs, info = _job(server, "last", 60.0)  # nobody is counted lost by silence here
    order: list[str] = []
    try:
        t = _ending(hs[0], info, True, ResultState.FAILED, order)
        t.join(1.0)
        assert order == [], "the host left while both peers still beat"
        for h in hs[1:]:
            order.append(f"{h.node_id} left")
            h.close(leaving=True)
            t.join(0.5 if h is hs[1] else 120)
        assert order == ["b left", "c left", "host gone"]
    finally:
        _close(hs)


def test_a_peer_that_falls_silent_is_waited_for_only_its_heartbeat_timeout(server: TCPStore) -> None:
    hs, info = _job(server, "silent", 2.0)
    order: list[str] = []
    try:
        hs[1].close(leaving=True)
        hs[2].close(leaving=False)  # stops beating without a word, as a frozen host
        t0 = time.monotonic()
        t = _ending(hs[0], info, True, ResultState.FAILED, order)
        t.join(120)
        assert order == ["host gone"] and time.monotonic() - t0 >= 1.0  # c's silence was waited out
    finally:
        _close(hs)


@pytest.mark.parametrize("hosts,state", [(False, ResultState.FAILED), (True, ResultState.SUCCEEDED),
                                         (True, ResultState.SIGNALLED)],
                         ids=["not-hosting", "succeeded", "signalled"])
def test_the_others_end_at_once(server: TCPStore, hosts: bool, state: ResultState) -> None:
    """The red side: where there is nothing to wait for, the host leaves while peers still beat."""
    hs, info = _job(server, f"now-{hosts}-{state.name}", 60.0)
    order: list[str] = []
    try:
        _ending(hs[0], info, hosts, state, order).join(120)
        assert order == ["host gone"]
    finally:
        _close(hs)

"""A round whose group rank 0 dies right after it closes (before publishing the workers'
MASTER_ADDR/PORT) is abandoned within a heartbeat timeout, and the agent moves on to the next
round; it used to wait the whole join timeout (600 s) for an address that never came."""
from __future__ import annotations

import time
from typing import Iterator

import pytest

from elastictk.agent.coordination import agree_master
from elastictk.rendezvous import RendezvousHandler, RoundAbandoned
from elastictk.store import TCPStore
from tests.test_rendezvous import fast, infos, join_all


@pytest.fixture
def server() -> Iterator[TCPStore]:
    s = TCPStore.serve(timeout=20)
    try:
        yield s
    finally:
        s.close()


def test_a_missing_master_address_abandons_the_round_quickly(server: TCPStore) -> None:
    hs = [RendezvousHandler(TCPStore("127.0.0.1", server.port, timeout=20), fast("abandon", 2, 2),
                            node_id=n) for n in "ab"]
    try:
        rounds = infos(join_all(hs))
        follower = next(i for i in rounds.values() if i.rank != 0)
        t0 = time.monotonic()
        with pytest.raises(RoundAbandoned, match="no MASTER_ADDR/PORT from group rank 0"):
            agree_master(follower, "127.0.0.1", 0.5)  # rank 0 never writes it: it "died"
        assert time.monotonic() - t0 < 5
        leader = next(i for i in rounds.values() if i.rank == 0)
        assert agree_master(leader, "127.0.0.1", 0.5)[0] == "127.0.0.1"
        assert agree_master(follower, "127.0.0.1", 0.5)[0] == "127.0.0.1"  # now it is there
    finally:
        for h in hs:
            h.close()

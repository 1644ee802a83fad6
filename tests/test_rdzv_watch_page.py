"""A membership watch reads the next round's arrivals a page at a time on a counter store
(TCPStore): when a whole job re-forms, a watcher that wakes late must not read every arrival so
far in one request (O(N) each, O(N^2) for the job) to find the first that wakes it."""
from __future__ import annotations

from typing import Any, Iterator

import pytest

from elastictk.rendezvous import MembershipWatch, RendezvousHandler
from elastictk.rendezvous.watch import ARRIVALS_PAGE
from elastictk.store import TCPStore
from tests.helpers.rdzvjoin import end_joins, join_in_background
from tests.test_rendezvous import fast, infos, join_all

TOKEN = "page-token"


@pytest.fixture
def server() -> Iterator[TCPStore]:
    s = TCPStore.serve(timeout=20)
    yield s
    s.close()


def test_a_watch_reads_a_burst_of_arrivals_a_page_at_a_time(server: TCPStore) -> None:
    def connect() -> TCPStore:
        return TCPStore.connect(f"127.0.0.1:{server.port}", timeout=20)

    cfg = fast("late", 2, 3, token=TOKEN, heartbeat_timeout=30.0, join_timeout=60.0)
    hs = {n: RendezvousHandler(connect(), cfg, node_id=n) for n in "ab"}
    raw = connect()
    sizes: list[int] = []
    real_clone = hs["a"].store.clone

    def counting_clone() -> Any:  # the watch reads on a connection of its own: count its reads
        st = real_clone()
        multi_get = st.multi_get

        def counted(keys: list[str]) -> list[bytes | None]:
            sizes.append(len(keys))
            return multi_get(keys)
        st.multi_get = counted  # type: ignore[method-assign]
        return st

    watch, t = None, None
    try:
        first = infos(join_all([hs["a"], hs["b"]]))
        burst = 2 * ARRIVALS_PAGE + 1
        for _ in range(burst):  # strangers (unsigned): they never wake the job
            seq = raw.add("rdzv/late/r/2/arrivals", 1)
            raw.set(f"rdzv/late/r/2/slot/{seq}", b'{"node_id": "mallory"}')
        hs["a"].store.clone = counting_clone  # type: ignore[method-assign]
        watch = MembershipWatch(hs["a"], first["a"])
        assert not watch.wait(1.5), watch.reason

        t = join_in_background(hs["b"])  # stopped below, once the watch has seen b arrive
        assert watch.wait(30) and "round 2 opened" in (watch.reason or ""), watch.reason
        assert sum(sizes) >= burst, f"the burst was read: {sizes}"
        assert max(sizes) <= ARRIVALS_PAGE, f"one request read {max(sizes)} arrivals: {sizes}"
    finally:
        end_joins(hs.values(), [t], watch)
        raw.close()

"""etcd's lease-ordered arrivals (``store/etcd_leased.py``) on a real etcd: an arrival and the
closer's election in one transaction, arrivals read in creation order and each once, a wait
on one's own key that ``stop()`` ends without a read that breaks the stream, and a creation
watch that holds one stream across its asks and is not woken by an update."""
from __future__ import annotations

import threading
import time
import uuid

from elastictk.store import PrefixStore
from elastictk.store.etcd import EtcdStore
from elastictk.testing.etcd import EtcdServer


def test_ordered_arrivals_on_a_real_etcd(etcd_server: EtcdServer) -> None:
    raw = EtcdStore(str(etcd_server.endpoint), timeout=20)
    s = PrefixStore(f"leased-{uuid.uuid4().hex[:8]}", raw)
    try:
        lease = s.grant_lease(30)
        assert s.arrive("r/1/a/x", b"X", lease, unless=["r/1/result"], claim=("r/1/closer", b"x")) == (True, True)
        assert s.arrive("r/1/a/y", b"Y", lease, unless=["r/1/result"], claim=("r/1/closer", b"y")) == (True, False)
        items, rev = s.created_since("r/1/a/", 0)
        assert items == [("x", b"X"), ("y", b"Y")] and s.count("r/1/a/") == 2
        assert s.created_since("r/1/a/", rev) == ([], rev)  # each arrival read once
        s.compare_set("r/1/result", None, b"R")
        assert s.arrive("r/1/a/z", b"Z", lease, unless=["r/1/result"]) == (False, False)  # closed: refused
        assert not s.claim("r/1/closer", b"z", lease)

        stop = threading.Event()
        threading.Timer(0.3, stop.set).start()
        t0 = time.monotonic()
        assert s.await_value("r/1/to/y", 60, stop.is_set) is None and time.monotonic() - t0 < 30
        threading.Timer(0.3, lambda: raw.clone().set(f"{s.prefix}r/1/to/y", b"assigned")).start()
        assert s.await_value("r/1/to/y", 60) == b"assigned"

        watch = s.watch_created("r/2/a/", 0)
        before = raw.requests
        assert not watch.wait(0.5) and not watch.wait(0.5)
        assert raw.requests - before == 1, "one stream across the asks"
        s.set("r/2/a/p", b"1")
        assert watch.wait(10)
        s.set("r/2/a/p", b"2")
        assert not watch.wait(0.8), "an update is no arrival"
        watch.close()
        s.revoke(lease)
        assert s.count("r/1/a/") == 0 and s.try_get("r/1/closer") is None  # gone with the lease
    finally:
        raw.close()

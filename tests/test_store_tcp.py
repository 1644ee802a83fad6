"""torch's c10d TCPStore behind the Store interface."""
from __future__ import annotations

import datetime
import threading
import time
from typing import Iterator

import pytest
import torch.distributed as dist

from elastictk.store import StoreUnreachable, TCPStore, quiet_port
from tests.helpers.store_contract import StoreContract


@pytest.fixture
def server() -> Iterator[TCPStore]:
    s = TCPStore.serve("127.0.0.1", 0, timeout=10)
    yield s
    s.close()


@pytest.fixture
def store(server: TCPStore) -> Iterator[TCPStore]:
    c = TCPStore.connect(f"127.0.0.1:{server.port}", timeout=10)
    yield c
    c.close()


class TestTCPStoreContract(StoreContract):
    pass


def test_port_zero_reports_the_chosen_port(server: TCPStore) -> None:
    assert server.port > 0
    assert server.describe() == f"tcp://127.0.0.1:{server.port}"


def test_unreachable_endpoint_fails_fast_with_one_line() -> None:
    port = quiet_port()
    start = time.monotonic()
    with pytest.raises(StoreUnreachable) as e:
        TCPStore.connect(f"127.0.0.1:{port}", timeout=2)
    assert time.monotonic() - start < 2.5
    msg = str(e.value)
    assert f"127.0.0.1:{port}" in msg and "\n" not in msg


def test_server_on_a_busy_port_names_the_port(server: TCPStore) -> None:
    with pytest.raises(StoreUnreachable, match=str(server.port)):
        TCPStore.serve("127.0.0.1", server.port, timeout=2)


def test_raw_store_is_usable_by_torch(store: TCPStore) -> None:
    store.raw.set("from-torch", "v")
    assert store.get("from-torch") == b"v"


def test_a_clone_of_a_view_owns_its_connection_and_closing_it_closes_it(store: TCPStore) -> None:
    from elastictk.store import PrefixStore, StoreClosed

    view = PrefixStore("job", store)
    clone = view.clone()
    clone.set("k", b"v")
    clone.close()
    with pytest.raises(StoreClosed):
        clone.try_get("k")
    assert view.try_get("k") == b"v", "closing a clone leaves the view and its store open"
    view.close()
    assert store.try_get("job/k") == b"v", "closing a view leaves the store under it open"


def _blocked_get(server: TCPStore, key: str) -> tuple[threading.Thread, dict[str, object]]:
    """A plain torch client (a worker's) blocked in ``get`` on ``key``."""
    raw = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                        timeout=datetime.timedelta(seconds=20), use_libuv=True)
    raw.set_timeout(datetime.timedelta(seconds=1.5))  # connecting may take longer on a busy host
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = raw.get(key)
        except RuntimeError as e:
            out["error"] = str(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.3)  # the get is waiting at the server
    return t, out


def test_reading_an_absent_key_wakes_no_one_waiting_for_it(server: TCPStore, store: TCPStore) -> None:
    """A worker blocked in torch's ``get`` stays blocked while an agent polls the absent key
    (the in-place agent polls the next generation's record while the workers wait on it)."""
    t, out = _blocked_get(server, "next")
    for _ in range(5):
        assert store.try_get("next") is None
    t.join(5)
    assert "value" not in out and "timeout" in str(out.get("error", "")).lower(), out


def test_the_failing_side_a_compare_and_set_read_hands_a_waiter_empty_bytes(server: TCPStore) -> None:
    """Why ``try_get`` checks first: c10d's compare-and-set on an absent key wakes the waiters,
    whose ``get`` then returns b"" for a key nobody wrote."""
    t, out = _blocked_get(server, "next")
    server.raw.compare_set("next", "\x00absent", "\x00absent")
    t.join(5)
    assert out.get("value") == b"", out

"""torch's c10d TCPStore behind the Store interface."""
from __future__ import annotations

import time
from typing import Iterator

import pytest

from elastictk.store import StoreUnreachable, TCPStore, free_port
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
    port = free_port()
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

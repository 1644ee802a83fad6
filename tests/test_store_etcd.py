"""etcd v3 behind the Store interface, against a real etcd (and real processes racing on it)."""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastictk.store import (
    Deadline,
    Endpoint,
    EndpointError,
    EtcdStore,
    StoreClosed,
    StoreError,
    StoreTimeout,
    StoreUnreachable,
    quiet_port,
)
from elastictk.store.base import _BACKOFF_CAP, _BACKOFF_FIRST, Backoff
from elastictk.store.etcd import LeaseExpired, parse_endpoints, range_end
from elastictk.testing.etcd import EtcdNotInstalled, EtcdServer, EtcdStartError, find_etcd
from elastictk.testing.etcdcluster import EtcdCluster
from tests.helpers.store_contract import StoreContract

REPO = Path(__file__).resolve().parents[1]


def _etcd_missing() -> str:
    try:
        find_etcd()
    except EtcdNotInstalled as e:
        return str(e)
    return ""


# for tests that start their own etcd (the rest use the session's `etcd_server` fixture)
needs_etcd = pytest.mark.skipif(bool(_etcd_missing()), reason=_etcd_missing() or "-")


@pytest.fixture
def store(etcd_server: EtcdServer) -> Iterator[EtcdStore]:
    s = EtcdStore(etcd_server.endpoint, prefix=f"test-{uuid.uuid4().hex}", timeout=10)
    yield s
    s.close()


class TestEtcdStoreContract(StoreContract):
    pass


def _python(code: str, *args: str, **kw: object) -> "subprocess.Popen[str]":
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw,  # type: ignore[call-overload]
    )


def _one_line(e: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# -- pure helpers ----------------------------------------------------------------------------
@given(prefix=st.binary(max_size=4), key=st.binary(max_size=6))
def test_range_end_bounds_exactly_the_keys_with_the_prefix(prefix: bytes, key: bytes) -> None:
    end = range_end(prefix)
    if end == b"\0":  # no upper bound: only for an empty or all-0xff prefix
        assert all(b == 0xFF for b in prefix)
        in_range = key >= prefix
    else:
        in_range = prefix <= key < end
    assert in_range == key.startswith(prefix)


def test_endpoints_parse_with_the_etcd_default_port() -> None:
    assert parse_endpoints("a:1,b") == [Endpoint("a", 1), Endpoint("b", 2379)]
    assert parse_endpoints(["[::1]:5"]) == [Endpoint("::1", 5)]
    assert parse_endpoints("http://a:1,http://b/") == [Endpoint("a", 1), Endpoint("b", 2379)]
    assert parse_endpoints("https://[::1]:5") == [Endpoint("::1", 5)]
    with pytest.raises(EndpointError, match="scheme"):
        EtcdStore("unix://127.0.0.1:2379")


# -- the store on the shared server ----------------------------------------------------------
def test_describe_lists_every_endpoint(etcd_server: EtcdServer) -> None:
    with EtcdStore([etcd_server.endpoint, "127.0.0.1:1"], timeout=5) as s:
        assert s.describe() == f"etcd://{etcd_server.endpoint},127.0.0.1:1"


def test_a_counter_that_is_not_a_number_is_an_error(store: EtcdStore) -> None:
    store.set("c", b"abc")
    with pytest.raises(StoreError, match="not a decimal counter"):
        store.add("c", 1)


def test_adding_zero_is_a_read_that_writes_nothing(store: EtcdStore) -> None:
    assert store.add("absent", 0) == 0
    assert store.try_get("absent") == b"0"  # created once, as every backend does
    store.add("c", 3)
    revision = lambda: int(store._call("/v3/kv/range", {"key": "AA=="})["header"]["revision"])  # noqa: E731
    rev, before = revision(), store.requests
    assert store.add("c", 0) == 3
    assert store.requests - before == 1  # one range, no transaction
    assert revision() == rev  # nothing written
    store.set("bad", b"abc")
    with pytest.raises(StoreError, match="not a decimal counter"):
        store.add("bad", 0)


@given(st.lists(st.floats(0.0, 5.0), min_size=1, max_size=30))
def test_backoff_pauses_grow_up_to_a_cap_and_never_past_the_deadline(lefts: list[float]) -> None:
    slept: list[float] = []
    pause = Backoff(sleep=slept.append)
    for i, left in enumerate(lefts):
        pause.sleep(Deadline(left))
        bound = min(_BACKOFF_FIRST * 2 ** i, _BACKOFF_CAP)
        assert 0.0 <= slept[-1] <= min(bound, left) + 1e-9
    assert pause.tries == len(lefts) and _BACKOFF_CAP <= 0.1


def test_closed_store_refuses_calls(store: EtcdStore) -> None:
    store.close()
    store.close()
    with pytest.raises(StoreClosed):
        store.set("k", b"v")


def test_wait_watches_instead_of_polling(store: EtcdStore) -> None:
    before = store.requests
    with pytest.raises(StoreTimeout, match="never"):
        store.wait(["never"], timeout=1.5)
    assert store.requests - before <= 2  # one read and one watch stream, however long it waits


def test_many_keys_read_as_one_snapshot(store: EtcdStore) -> None:
    keys = [f"k{i}" for i in range(300)]  # more than one etcd transaction holds
    store.set("k7", b"7")
    assert store.multi_get(keys) == [b"7" if k == "k7" else None for k in keys]
    with store.clone() as other:
        for k in keys[:-1]:
            other.set(k, k.encode())
        with pytest.raises(StoreTimeout, match="k299"):
            store.wait(keys, timeout=0.2)
        t = threading.Timer(0.2, lambda: other.set("k299", b"last"))
        t.start()
        store.wait(keys, timeout=30)
        t.join()
    assert store.multi_get(keys)[-2:] == [b"k298", b"last"]


def test_wait_ignores_keys_it_did_not_ask_for(store: EtcdStore) -> None:
    with store.clone() as other:
        t = threading.Timer(0.1, lambda: (other.set("b", b""), other.set("a", b"")))
        t.start()
        with pytest.raises(StoreTimeout) as e:  # "b" lies between "a" and "c"
            store.wait(["a", "c"], timeout=1)
        t.join()
    assert "'c'" in str(e.value) and "'a'" not in str(e.value)


def test_wait_absent_sees_a_delete(store: EtcdStore) -> None:
    store.set("gone", b"x")
    with pytest.raises(StoreTimeout, match="disappear"):
        store.wait_absent(["gone"], timeout=0.3)
    other = store.clone()
    try:
        t = threading.Timer(0.2, lambda: other.delete("gone"))
        t.start()
        store.wait_absent(["gone"], timeout=20)
        t.join()
    finally:
        other.close()
    assert store.try_get("gone") is None


def test_get_wakes_on_a_key_set_by_another_process(store: EtcdStore,
                                                   etcd_server: EtcdServer) -> None:
    child = _python(
        """
        import sys
        from elastictk.store import EtcdStore
        s = EtcdStore(sys.argv[1], prefix=sys.argv[2], timeout=30)
        s.wait(["ready"], 60)
        s.set("answer", b"42")
        """,
        etcd_server.endpoint, store.prefix,
    )
    before = store.requests
    releaser = threading.Thread(target=_once_watching, args=(store, before, "ready"))
    releaser.start()
    try:
        assert store.get("answer", timeout=60) == b"42"  # set while this get was watching
        assert store.requests - before == 2  # one read, one watch: it woke on the event
        assert child.wait(timeout=60) == 0
    finally:
        releaser.join(timeout=60)
        child.kill()
        child.communicate()


def _once_watching(store: EtcdStore, before: int, key: str) -> None:
    """Set ``key`` (on a clone) once ``store`` has read and opened its watch."""
    deadline = time.monotonic() + 30
    while store.requests < before + 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # test-side sync on the store's own counter
    with store.clone() as other:
        other.set(key, b"1")


_RACER = """
    import os, sys
    from elastictk.store import EtcdStore
    s = EtcdStore(sys.argv[1], prefix=sys.argv[2], timeout=60)
    n = int(sys.argv[3])
    s.wait(["go"], 60)
    got = []
    for i in range(n):
        got.append(s.add("ctr", 1))
        # compare_set increment; the desired value is unique to this writer, so seeing it back
        # means this writer's swap happened (not an equal value written by someone else)
        cur = s.try_get("cas")
        while True:
            count = int(cur.split(b":")[0]) if cur else 0
            desired = f"{count + 1}:{os.getpid()}:{i}".encode()
            after = s.compare_set("cas", cur, desired)
            if after == desired:
                break
            cur = after
    print(" ".join(map(str, got)))
"""


def test_add_and_compare_set_are_atomic_across_processes(store: EtcdStore,
                                                         etcd_server: EtcdServer) -> None:
    procs, n = 8, 15
    children = [_python(_RACER, etcd_server.endpoint, store.prefix, str(n)) for _ in range(procs)]
    try:
        store.set("go", b"1")
        seen: list[int] = []
        for c in children:
            out, err = c.communicate(timeout=180)
            assert c.returncode == 0, err[-2000:]
            seen += [int(x) for x in out.split()]
    finally:
        for c in children:
            c.kill()
            c.communicate()
    assert sorted(seen) == list(range(1, procs * n + 1))  # every add saw a distinct value
    assert store.get("ctr") == str(procs * n).encode()
    assert int(store.get("cas").split(b":")[0]) == procs * n


def test_revoked_lease_takes_its_keys(store: EtcdStore) -> None:
    lease = store.grant_lease(30)
    store.set_with_lease("a", b"1", lease)
    store.set_with_lease("b", b"2", lease)
    assert store.keepalive(lease) >= 29
    assert store.revoke(lease) is True
    assert store.multi_get(["a", "b"]) == [None, None]
    assert store.revoke(lease) is False
    with pytest.raises(LeaseExpired, match="expired or was revoked"):
        store.keepalive(lease)
    with pytest.raises(LeaseExpired):
        store.set_with_lease("c", b"3", lease)


def test_leased_key_dies_with_its_owner(store: EtcdStore, etcd_server: EtcdServer) -> None:
    owner = _python(
        """
        import sys, time
        from elastictk.store import EtcdStore
        s = EtcdStore(sys.argv[1], prefix=sys.argv[2], timeout=30)
        lease = s.grant_lease(2)
        s.set_with_lease("owner", b"alive", lease)
        beat = 0
        while True:  # renew well within the TTL, and say so
            s.keepalive(lease)
            beat += 1
            s.set(f"beat-{beat}", b"")
            time.sleep(0.5)
        """,
        etcd_server.endpoint, store.prefix,
    )
    try:
        store.wait(["owner"], timeout=60)
        # 8 renewals 0.5 s apart: the key has outlived its 2 s TTL only thanks to keepalives
        store.wait(["beat-8"], timeout=60)
        assert store.try_get("owner") == b"alive"
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        store.wait_absent(["owner"], timeout=60)
    finally:
        owner.kill()
        owner.communicate()
    assert store.try_get("beat-1") == b""  # keys without the lease stay


# -- reaching (or not) an endpoint -----------------------------------------------------------
def test_refused_endpoint_fails_fast_with_one_line() -> None:
    port = quiet_port()
    start = time.monotonic()
    with pytest.raises(StoreUnreachable) as e:
        EtcdStore(f"127.0.0.1:{port}", timeout=2)
    assert time.monotonic() - start < 2 + 3
    msg = _one_line(e)
    assert f"127.0.0.1:{port}" in msg and "refused" in msg and "check" in msg


def test_silent_endpoint_fails_within_the_timeout() -> None:
    with socket.socket() as listener:  # accepts connections (backlog), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(StoreUnreachable) as e:
            EtcdStore(f"127.0.0.1:{port}", timeout=1)
        assert time.monotonic() - start < 1 + 4
    msg = _one_line(e)
    assert f"127.0.0.1:{port}" in msg and "no answer" in msg


def test_something_that_is_not_etcd_is_named(etcd_server: EtcdServer) -> None:
    with pytest.raises(StoreUnreachable) as e:  # etcd's peer port speaks HTTP, not the v3 API
        EtcdStore(etcd_server.peer_endpoint, timeout=5)
    msg = _one_line(e)
    assert etcd_server.peer_endpoint in msg and "not etcd" in msg


def test_fails_over_to_a_live_endpoint(etcd_server: EtcdServer) -> None:
    dead = f"127.0.0.1:{quiet_port()}"
    with EtcdStore([dead, etcd_server.endpoint], prefix=uuid.uuid4().hex, timeout=5) as s:
        s.set("k", b"v")
        assert s.try_get("k") == b"v"
        assert s.add("n", 2) == 2


# -- outages ---------------------------------------------------------------------------------
@needs_etcd
def test_store_reports_an_outage_and_recovers_after_restart(tmp_path: Path) -> None:
    with EtcdServer(base_dir=tmp_path) as server:
        port = server.client_port
        s = EtcdStore(server.endpoint, timeout=5)
        s.set("k", b"kept")
        server.stop()
        assert not server.running
        with pytest.raises(StoreUnreachable, match=server.endpoint) as e:
            s.try_get("k")
        _one_line(e)
        with pytest.raises(StoreUnreachable):
            s.wait(["other"], timeout=5)
        with pytest.raises(StoreUnreachable):  # refused: the store is gone, however short the wait
            s.wait(["other"], timeout=0.05)
        server.start()
        assert server.client_port == port
        assert s.try_get("k") == b"kept"  # same data dir
        assert s.add("n", 1) == 1
        hung = EtcdStore(server.endpoint, timeout=1)
        server.pause()  # hung, not dead: sockets open, no answers
        try:
            start = time.monotonic()
            with pytest.raises(StoreUnreachable, match="no answer") as e:
                hung.try_get("k")
            _one_line(e)
            # A wait whose deadline passes while its read gets no answer (a busy or hung
            # server) has timed out: StoreTimeout, which a join rides out, not StoreUnreachable.
            with pytest.raises(StoreTimeout):
                hung.wait(["other"], timeout=0.3)
            with pytest.raises(StoreTimeout):
                hung.get("other", timeout=1)
            assert time.monotonic() - start < 3 * 1 + 5  # each bounded by its timeout (a read: 1 s)
        finally:
            server.resume()
        assert hung.try_get("k") == b"kept"
        hung.close()
        s.close()
    assert not server.root.exists()


@needs_etcd
def test_wait_survives_the_loss_of_a_cluster_member(tmp_path: Path) -> None:
    with EtcdCluster(3, base_dir=tmp_path) as cluster:
        store = EtcdStore(cluster.endpoints, prefix="f", timeout=20)
        waiter = store.clone()
        store.set("k", b"1")
        got: dict[str, object] = {}

        def wait_late() -> None:
            try:
                got["v"] = waiter.get("late", timeout=90)
            except Exception as e:  # reported by the assertion below
                got["v"] = e

        thread = threading.Thread(target=wait_late)
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while waiter.requests < 2 and time.monotonic() < deadline:  # its watch is open
                time.sleep(0.01)
            cluster.members[0].stop()  # the member both stores were talking to
            assert store.add("n", 1) == 1
            store.set("late", b"v")
            thread.join(timeout=90)
            assert got.get("v") == b"v"
            cluster.members[0].start()  # rejoins with its data
            cluster.members[1].stop()
            assert store.try_get("k") == b"1"
            assert store.add("n", 1) == 2
        finally:
            store.close()
            waiter.close()
            thread.join(timeout=90)


# -- the launcher ----------------------------------------------------------------------------
def test_missing_binary_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(EtcdNotInstalled, match="apt-get install etcd-server"):
        EtcdServer(binary=tmp_path / "no-etcd-here")
    assert not list(tmp_path.iterdir())


@needs_etcd
def test_a_failed_start_quotes_etcd_and_leaves_nothing(tmp_path: Path) -> None:
    server = EtcdServer(base_dir=tmp_path, extra_args=["--no-such-flag"])
    with pytest.raises(EtcdStartError) as e:
        server.start()
    msg = _one_line(e)
    assert "exited" in msg and str(server.log_path) in msg
    server.close()
    assert not server.root.exists()


@needs_etcd
def test_etcd_dies_with_its_owner(tmp_path: Path) -> None:
    owner = _python(
        """
        import sys
        from elastictk.testing import EtcdServer
        server = EtcdServer(base_dir=sys.argv[1]).start()
        print(server.pid, flush=True)
        sys.stdin.read()  # until the test kills this process
        """,
        str(tmp_path), stdin=subprocess.PIPE,
    )
    try:
        assert owner.stdout is not None
        ready, _, _ = select.select([owner.stdout], [], [], 120)
        assert ready, "the owner did not start etcd in time"
        etcd = psutil.Process(int(owner.stdout.readline()))
        assert "etcd" in etcd.name()
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=30)
        etcd.wait(timeout=30)  # PR_SET_PDEATHSIG took it down
    finally:
        owner.kill()
        owner.communicate()

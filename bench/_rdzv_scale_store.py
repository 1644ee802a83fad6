"""The stores of the rendezvous scale benchmark: real servers in processes of their own, and a
counter of the operations the simulated nodes send them.

- TCPStore: torch's c10d server (libuv), started by ``elastictk.store.tcp.TCPStore.serve`` in
  a child Python process, so psutil measures the server's CPU alone (in the benchmark's
  process it would be mixed with a thousand client threads). It ends when its stdin closes:
  with this process, also when this process is killed.
- etcd: a real ``etcd`` (``elastictk.testing.etcd.EtcdServer``), its own process already.

:class:`CountingStore` wraps each node's store client (and every clone of it: the heartbeat's,
the membership watch's, the failure watch's) and counts the calls of elastictk's ``Store``
interface each makes. One call can be more than one request on the wire (a TCPStore
``try_get`` is a check and an atomic read; an etcd ``wait`` opens a watch stream), so the
server's CPU is measured too.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import psutil

from elastictk.store import Store

ROOT = Path(__file__).resolve().parent.parent

_SERVER = (
    "import sys\n"
    "from elastictk.store.tcp import TCPStore\n"
    "s = TCPStore.serve('127.0.0.1', 0, timeout=600)\n"
    "print(s.port, flush=True)\n"
    "sys.stdin.read()\n"
)


class Tally:
    """Store calls by operation, shared by every client of one case (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()

    def add(self, op: str) -> None:
        with self._lock:
            self.calls[op] += 1

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.calls)


class Meter:
    """One connection's own calls, bytes and wake-ups (not its clones'): what one join costs.

    Bytes are keys and values as elastictk hands them to the store and gets them back (the
    wire adds a few bytes of framing per call: TCPStore's length prefixes, etcd's base64 and
    JSON). A wake-up is a ``wait`` that returned because its keys appeared; ``waits`` counts
    every wait, also those that timed out (a node's slice of waiting)."""

    FIELDS = ("calls", "bytes_out", "bytes_in", "waits", "wakeups")

    def __init__(self) -> None:
        self.calls = self.bytes_out = self.bytes_in = self.waits = self.wakeups = 0

    def snapshot(self) -> dict[str, int]:
        return {f: getattr(self, f) for f in self.FIELDS}


def _n(keys: Iterable[str]) -> int:
    return sum(len(k.encode()) for k in keys)


class CountingStore(Store):
    """``inner`` with every call counted in ``tally``; clones are counted in the same tally.
    ``meter`` (when given) counts this connection's own calls and bytes, not its clones'."""

    def __init__(self, inner: Store, tally: Tally, meter: Meter | None = None) -> None:
        self.inner, self.tally, self.meter = inner, tally, meter

    def _count(self, op: str, out: int, inn: int = 0) -> None:
        self.tally.add(op)
        m = self.meter
        if m is not None:
            m.calls += 1
            m.bytes_out += out
            m.bytes_in += inn

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, value)
        self._count("set", _n([key]) + len(value))

    def try_get(self, key: str) -> bytes | None:
        got = self.inner.try_get(key)
        self._count("get", _n([key]), len(got or b""))
        return got

    def multi_get(self, keys: Iterable[str]) -> list[bytes | None]:
        keys = list(keys)
        got = self.inner.multi_get(keys)
        self._count("multi_get", _n(keys), sum(len(v or b"") for v in got))
        return got

    def multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        items = list(items)
        self.inner.multi_set(items)
        self._count("multi_set", sum(len(k.encode()) + len(v) for k, v in items))

    def add(self, key: str, amount: int) -> int:
        got = self.inner.add(key, amount)
        self._count("add", _n([key]) + len(str(amount)), len(str(got)))
        return got

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes | None:
        got = self.inner.compare_set(key, expected, desired)
        self._count("compare_set", _n([key]) + len(expected or b"") + len(desired), len(got or b""))
        return got

    def delete(self, key: str) -> bool:
        self._count("delete", _n([key]))
        return self.inner.delete(key)

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        self._count("wait", _n(keys))
        m = self.meter
        if m is not None:
            m.waits += 1
        self.inner.wait(keys, timeout)
        if m is not None:
            m.wakeups += 1  # not reached when the wait timed out (StoreTimeout)

    def keys(self, prefix: str = "") -> list[str]:
        got = self.inner.keys(prefix)
        self._count("keys", _n([prefix]), _n(got))
        return got

    # -- etcd's lease-ordered arrivals: each call one request, counted like the others ------
    @property
    def ordered_arrivals(self) -> bool:  # type: ignore[override]
        return self.inner.ordered_arrivals

    def grant_lease(self, ttl: float) -> int:
        got = self.inner.grant_lease(ttl)
        self._count("grant_lease", 8, 8)
        return got

    def keepalive(self, lease_id: int) -> float:
        got = self.inner.keepalive(lease_id)
        self._count("keepalive", 8, 8)
        return got

    def revoke(self, lease_id: int) -> bool:
        got = self.inner.revoke(lease_id)
        self._count("revoke", 8)
        return got

    def arrive(self, key: str, value: bytes, lease: int, *, unless: Sequence[str] = (),
               claim: tuple[str, bytes] | None = None) -> tuple[bool, bool]:
        got = self.inner.arrive(key, value, lease, unless=unless, claim=claim)
        claimed = 0 if claim is None else _n([claim[0]]) + len(claim[1])
        self._count("arrive", _n([key]) + len(value) + 8 + _n(unless) + claimed, 2)
        return got

    def claim(self, key: str, value: bytes, lease: int) -> bool:
        got = self.inner.claim(key, value, lease)
        self._count("claim", _n([key]) + len(value) + 8, 1)
        return got

    def created_since(self, prefix: str, revision: int, limit: int = 0) -> tuple[list[tuple[str, bytes]], int]:
        got = self.inner.created_since(prefix, revision, limit) if limit > 0 else self.inner.created_since(prefix, revision)
        self._count("created_since", _n([prefix]) + 8, sum(len(k.encode()) + len(v) for k, v in got[0]) + 8)
        return got

    def wait_created(self, prefix: str, revision: int, count: int, timeout: float) -> bool:
        got = self.inner.wait_created(prefix, revision, count, timeout)
        self._count("wait_created", _n([prefix]) + 8)
        m = self.meter
        if m is not None:
            m.waits += 1
            m.wakeups += int(got)
        return got

    def watch_created(self, prefix: str, revision: int) -> Any:
        got = self.inner.watch_created(prefix, revision)
        self._count("watch_created", _n([prefix]) + 8)  # its waits make no request: not counted
        return got

    def count(self, prefix: str) -> int:
        got = self.inner.count(prefix)
        self._count("count", _n([prefix]), len(str(got)))
        return got

    def await_value(self, key: str, timeout: float, stop: Callable[[], bool] | None = None) -> bytes | None:
        got = self.inner.await_value(key, timeout, stop)
        self._count("await_value", _n([key]), len(got or b""))
        m = self.meter
        if m is not None:
            m.waits += 1
            m.wakeups += int(got is not None)
        return got

    # -- etcd's liveness by lease: the node's key under its lease, watched by its peers ------
    @property
    def lease_liveness(self) -> bool:  # type: ignore[override]
        return self.inner.lease_liveness

    def set_with_lease(self, key: str, value: bytes, lease_id: int) -> None:
        self.inner.set_with_lease(key, value, lease_id)
        self._count("set_with_lease", _n([key]) + len(value) + 8)

    def leased_get(self, keys: Sequence[str]) -> tuple[list[tuple[bytes | None, int]], int]:
        got = self.inner.leased_get(keys)
        self._count("leased_get", _n(keys), sum(len(v or b"") + 8 for v, _ in got[0]))
        return got

    def lease_ttl(self, lease_id: int) -> float:
        got = self.inner.lease_ttl(lease_id)
        self._count("lease_ttl", 8, 8)
        return got

    def watch_keys(self, keys: Sequence[str], revision: int) -> Any:
        got = self.inner.watch_keys(keys, revision)
        self._count("watch_keys", _n(keys) + 8)  # its asks make no request: not counted
        return got

    @property
    def requests(self) -> int | None:
        """Requests on the wire so far (etcd: unary calls and watch streams), where known."""
        r = getattr(self.inner, "requests", None)
        return r if isinstance(r, int) else None

    def clone(self) -> "CountingStore":
        self.tally.add("clone")
        return CountingStore(self.inner.clone(), self.tally)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return self.inner.describe()


@dataclass
class Server:
    """A running store server: how to reach it, its process, and how to stop it."""

    backend: str
    endpoint: str
    pid: int
    _stop: "subprocess.Popen[str] | object"

    def cpu_seconds(self) -> float:
        """User + system CPU the server process has used so far."""
        t = psutil.Process(self.pid).cpu_times()
        return float(t.user + t.system)

    def rss_mib(self) -> float:
        return float(psutil.Process(self.pid).memory_info().rss) / 2**20

    def connect(self, tally: Tally, meter: Meter | None = None) -> CountingStore:
        return connect(self.backend, self.endpoint, tally, meter)

    def close(self) -> None:
        stop = self._stop
        if isinstance(stop, subprocess.Popen):
            if stop.stdin is not None:
                stop.stdin.close()  # the server's cue to exit
            try:
                stop.wait(timeout=10)
            except subprocess.TimeoutExpired:
                stop.kill()
                stop.wait()
            if stop.stdout is not None:
                stop.stdout.close()
        else:
            stop.close()  # type: ignore[attr-defined]  # an EtcdServer


def connect(backend: str, endpoint: str, tally: Tally, meter: Meter | None = None) -> CountingStore:
    """A new client of a server (one node's own connection), counted in ``tally`` (and its own
    calls in ``meter``)."""
    if backend == "tcp":
        from elastictk.store.tcp import TCPStore

        return CountingStore(TCPStore.connect(endpoint, timeout=120), tally, meter)
    from elastictk.store.etcd import EtcdStore

    return CountingStore(EtcdStore(endpoint, timeout=120), tally, meter)


def start(backend: str, tmp: str) -> Server:
    """A fresh server for one case: ``tcp`` or ``etcd``."""
    if backend == "tcp":
        proc = subprocess.Popen([sys.executable, "-c", _SERVER], cwd=ROOT, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.isdigit():
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the TCPStore server did not start (it printed {line!r})")
        return Server("tcp", f"127.0.0.1:{line}", proc.pid, proc)
    from elastictk.testing.etcd import EtcdServer

    etcd = EtcdServer(base_dir=tmp).start()
    assert etcd.pid is not None
    return Server("etcd", str(etcd.endpoint), etcd.pid, etcd)


def cpu_window(server: Server, seconds: float) -> tuple[float, float]:
    """The server's CPU seconds per second over a window of ``seconds`` (and the window)."""
    c0, t0 = server.cpu_seconds(), time.monotonic()
    time.sleep(seconds)
    c1, t1 = server.cpu_seconds(), time.monotonic()
    return (c1 - c0) / (t1 - t0), t1 - t0

"""Store round trips: set / get / add against elastictk's stores and torch's, 1 and 16 clients.

Every rendezvous round, heartbeat and restart decision is a handful of store round trips, so
their cost bounds how fast a job can re-form. Each client is its own process (threads would
measure the GIL): with one client a sample shows the latency of a round trip, with sixteen on a
small machine it shows how a store holds up under contention, which is what a rendezvous of a
whole job looks like to the store.

Subjects and their references (same run, interleaved samples):

- elastictk ``TCPStore`` vs torch ``TCPStore`` (libuv servers, both hosted by this process);
  ours wraps torch's own client and server, so this ratio is the cost of the wrapper
- elastictk ``FileStore`` vs torch ``FileStore`` (both in the same temporary directory); ours
  twice: by default (``durable=True``, an fsync per written value, which torch's never does)
  and with ``durable=False``, the like-for-like setting
- elastictk ``EtcdStore`` (a real etcd started for the run) vs torch ``TCPStore``: torch has no
  usable etcd v3 store, so its fastest store is the yardstick.

How the c10d client works explains some ratios: torch's ``TCPStore.set`` sends without waiting
for an answer, and its ``get`` first waits for the key and then reads it (two round trips),
while elastictk's ``get`` of an existing key is a single ``compare_set`` round trip.

Ops: ``set`` of a 100-byte value to a key of the client's own; ``get`` of an existing key of the
client's own; ``add(key, 1)`` on ONE counter shared by all clients (checked afterwards: the
counter must equal the number of adds). A sample is every client doing ``n`` ops at once; its
value is the aggregate ops/s over the window from the first client's start to the last one's end.
``n`` is calibrated per store so that a sample lasts about ``sample_seconds``. A client's ``set``
window ends with one ``get`` of its key, because torch's TCPStore answers no set: without it
the window would close while the server still had the sets queued.
"""
from __future__ import annotations

import datetime
import math
import os
import shutil
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ._pool import ClientPool
from .common import BenchError, BenchResult, Comparison, Measured, RunConfig, interleaved

TITLE = "Store round trips (set / get / add), elastictk vs torch"
OPS = ("set", "get", "add")
VALUE = b"v" * 100
ETCD_NOTE = (
    "torch 2.13 has no usable etcd v3 store (its EtcdStore speaks the v2 API through the "
    "python-etcd package), so elastictk's EtcdStore is compared with torch's TCPStore, the "
    "fastest torch store: the ratio is the price of a replicated, crash-surviving store."
)


@dataclass(frozen=True)
class Subject:
    key: str
    label: str
    spec: dict[str, Any]  # plain data: how a client process opens it


# -- inside each client process ----------------------------------------------------------------
def _open(spec: dict[str, Any]) -> Any:
    """A store client from a plain-data spec; runs in the client process."""
    kind = spec["kind"]
    if kind == "torch-tcp":
        import torch.distributed as dist

        return dist.TCPStore(
            "127.0.0.1", spec["port"], is_master=False,
            timeout=datetime.timedelta(seconds=60), use_libuv=True,
        )
    if kind == "torch-file":
        import torch.distributed as dist

        return dist.FileStore(spec["path"], -1)
    if kind == "etk-tcp":
        from elastictk.store.tcp import TCPStore

        return TCPStore.connect(f"127.0.0.1:{spec['port']}", timeout=60)
    if kind == "etk-file":
        from elastictk.store.file import FileStore

        return FileStore(spec["path"], timeout=60, durable=spec["durable"])
    if kind == "etk-etcd":
        from elastictk.store.etcd import EtcdStore

        return EtcdStore(spec["endpoint"], prefix=spec["prefix"], timeout=60)
    raise BenchError(f"unknown store kind {kind!r}")


def client(state: dict, cmd: str, arg: Any) -> Any:
    """The :class:`ClientPool` handler: open / run / close stores by subject key."""
    if cmd == "open":
        subject, spec, key, counter = arg["subject"], arg["spec"], arg["key"], arg["counter"]
        store = _open(spec)
        store.set(key, VALUE)  # so that ``get`` finds it
        state[subject] = {"store": store, "key": key, "counter": counter, "adds": 0, "last": 0}
        return None
    if cmd == "run":
        subject, op, n = arg
        s = state[subject]
        return _timed_ops(s, op, n)
    if cmd == "close":
        s = state.pop(arg)
        _close(s["store"])
        return {"adds": s["adds"], "last": s["last"]}
    if cmd == "__exit__":
        for s in state.values():
            _close(s["store"])
        state.clear()
        return None
    raise BenchError(f"unknown command {cmd!r}")


def _timed_ops(s: dict, op: str, n: int) -> tuple[float, float]:
    store, key = s["store"], s["key"]
    if op == "set":
        fn: Callable[[], Any] = lambda: store.set(key, VALUE)
    elif op == "get":
        fn = lambda: store.get(key)
    elif op == "add":
        counter, add = s["counter"], store.add
        fn = lambda: add(counter, 1)
    else:
        raise BenchError(f"unknown op {op!r}")
    last = None
    t0 = time.monotonic()
    for _ in range(n):
        last = fn()
    if op == "set":
        # torch's TCPStore sends a set without waiting for an answer: one read on the same
        # connection makes the window end when the server has applied every set.
        store.get(key)
    t1 = time.monotonic()
    if op == "add":
        s["adds"] += n
        s["last"] = max(s["last"], int(last))
    return t0, t1


def _close(store: Any) -> None:
    close = getattr(store, "close", None)  # torch's stores close when collected
    if close is not None:
        close()


# -- in the benchmark process ------------------------------------------------------------------
class _Stores:
    """Starts what the subjects need (servers, etcd, a temp dir) and says what was skipped."""

    def __init__(self, stack: ExitStack, log: Callable[[str], None]) -> None:
        self.notes: list[str] = []
        self.pids: list[int] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="etk-bench-store-"))
        stack.callback(shutil.rmtree, self.tmp, True)
        import torch.distributed as dist

        from elastictk.store.tcp import TCPStore

        ours = TCPStore.serve("127.0.0.1", 0, timeout=60)
        stack.callback(ours.close)
        theirs = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=60), use_libuv=True,
        )
        self.tcp_ports = {"etk-tcp": ours.port, "torch-tcp": int(theirs.port)}
        self._servers = [ours, theirs]  # torch's server stops when its last reference goes
        stack.callback(self._servers.clear)
        self.have_file = self._importable(
            "elastictk.store.file", "FileStore", "elastictk FileStore")
        self.etcd_endpoint: str | None = None
        if self._importable("elastictk.store.etcd", "EtcdStore", "elastictk EtcdStore") and \
                self._importable("elastictk.testing.etcd", "EtcdServer", "the etcd launcher"):
            self._start_etcd(stack, log)

    def _importable(self, module: str, attr: str, what: str) -> bool:
        try:
            getattr(__import__(module, fromlist=[attr]), attr)
            return True
        except (ImportError, AttributeError) as e:
            self.notes.append(f"skipped {what}: {module}.{attr} is not importable ({e})")
            return False

    def _start_etcd(self, stack: ExitStack, log: Callable[[str], None]) -> None:
        from elastictk.testing.etcd import EtcdServer

        log("starting etcd ...")
        try:
            server = EtcdServer(base_dir=self.tmp).start()
        except Exception as e:  # a missing binary, a port clash: skip etcd, say so
            self.notes.append(f"skipped elastictk EtcdStore: etcd did not start ({e})")
            return
        stack.callback(server.close)
        self.etcd_endpoint = str(server.endpoint)
        pid = getattr(server, "pid", None)
        if pid:
            self.pids.append(int(pid))

    def subjects(self, case: str) -> dict[str, Subject]:
        """Fresh keys (and fresh files) per case, so one case's leftovers never slow the next."""
        specs: dict[str, tuple[str, dict[str, Any]]] = {
            "etk-tcp": ("TCPStore", {"kind": "etk-tcp", "port": self.tcp_ports["etk-tcp"]}),
            "torch-tcp": ("torch TCPStore", {
                "kind": "torch-tcp", "port": self.tcp_ports["torch-tcp"]}),
        }
        if self.have_file:
            d = self.tmp
            specs["etk-file"] = ("FileStore (default: fsync)", {
                "kind": "etk-file", "path": str(d / f"{case}-etk"), "durable": True})
            specs["etk-file-nosync"] = ("FileStore durable=False", {
                "kind": "etk-file", "path": str(d / f"{case}-etk-nosync"), "durable": False})
            specs["torch-file"] = ("torch FileStore", {
                "kind": "torch-file", "path": str(d / f"{case}-torch")})
        if self.etcd_endpoint:
            specs["etk-etcd"] = ("EtcdStore", {
                "kind": "etk-etcd", "endpoint": self.etcd_endpoint, "prefix": f"bench/{case}"})
        return {key: Subject(key, label, spec) for key, (label, spec) in specs.items()}


PRELOAD = (
    "torch.distributed", "elastictk.store.tcp", "elastictk.store.file", "elastictk.store.etcd",
)
PAIRS = (
    ("etk-tcp", "torch-tcp", ""),
    ("etk-file", "torch-file", ""),
    ("etk-file-nosync", "torch-file", ""),
    ("etk-etcd", "torch-tcp", ETCD_NOTE),
)


def _case(
    pool: ClientPool, stores: _Stores, op: str, clients: int, cfg: RunConfig
) -> list[Comparison]:
    case = f"{op}-{clients}"
    subjects = stores.subjects(case)
    which = range(clients)
    timeout = 120.0
    for key, sub in subjects.items():
        pool.call(which, "open", [
            {"subject": key, "spec": sub.spec, "key": f"{case}/c{i}", "counter": f"{case}/counter"}
            for i in which
        ], timeout)

    def sample(key: str, n: int) -> tuple[float, float]:
        spans = pool.call(which, "run", [(key, op, n)] * clients, timeout)
        window = max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)
        per_client_us = sorted((t1 - t0) / n * 1e6 for t0, t1 in spans)
        return clients * n / max(window, 1e-9), per_client_us[len(per_client_us) // 2]

    # Calibrate each store (this first, discarded sample also warms up its connections).
    n_of: dict[str, int] = {}
    for key in subjects:
        n0 = 5 if cfg.quick else 20
        rate, _ = sample(key, n0)
        n_of[key] = max(3, min(200_000, math.ceil(rate * cfg.sample_seconds / clients)))
    latency: dict[str, list[float]] = {k: [] for k in subjects}

    def one(key: str) -> float:
        rate, lat = sample(key, n_of[key])
        latency[key].append(lat)
        return rate

    samples = interleaved(list(subjects), one, cfg.rounds)
    for key in subjects:
        finals = pool.call(which, "close", [key] * clients, timeout)
        if op == "add":
            total, last = sum(f["adds"] for f in finals), max(f["last"] for f in finals)
            if total != last:
                raise BenchError(
                    f"{subjects[key].label} lost updates: {total} concurrent adds left the "
                    f"counter at {last}"
                )
    rows = []
    for ours, ref, note in PAIRS:
        if ours in subjects and ref in subjects:
            def measured(k: str) -> Measured:
                return Measured(subjects[k].label, samples[k], {
                    "ops_per_client_per_sample": n_of[k],
                    "median_client_us_per_op": latency[k],
                })
            case_cols = {"op": op, "clients": str(clients)}
            rows.append(Comparison(case_cols, measured(ours), measured(ref), note))
    return rows


def _where(path: Path) -> str:
    """``/tmp (ext4)``: file and etcd numbers depend on the filesystem under them."""
    best, fstype = "", "unknown filesystem"
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1]
                inside = path == Path(mount) or Path(mount) in path.parents
                if inside and len(mount) > len(best):
                    best, fstype = mount, parts[2]
    except OSError:
        pass
    return f"{path} ({fstype})"


def run(cfg: RunConfig) -> BenchResult:
    client_counts = (1, 4) if cfg.quick else (1, 16)
    rows: list[Comparison] = []
    with ExitStack() as stack:
        stores = _Stores(stack, cfg.log)
        for note in stores.notes:
            cfg.log(f"note: {note}")
        cfg.log(f"starting {max(client_counts)} client processes ...")
        pool = stack.enter_context(ClientPool(
            max(client_counts), "bench.store:client", preload=PRELOAD))
        pids = pool.pids + stores.pids
        for clients in client_counts:
            for op in OPS:
                cfg.log(f"  {op} with {clients} client(s) ...")
                rows += _case(pool, stores, op, clients, cfg)
    return BenchResult(
        name="store",
        title=TITLE,
        description=(__doc__ or "").split("\n", 1)[1].strip(),
        unit="ops/s",
        higher_is_better=True,
        rows=rows,
        notes=stores.notes + [
            f"clients are processes; with {os.cpu_count()} cores here, {max(client_counts)} "
            "clients measure contention, not parallel speed",
            f"FileStore files and etcd's data live in {_where(stores.tmp.parent)}; etcd runs with "
            "its defaults (one member, WAL fsync on every write)",
        ],
        params={
            "ops": list(OPS), "clients": list(client_counts), "value_bytes": len(VALUE),
            "rounds": cfg.rounds, "sample_seconds": cfg.sample_seconds, "quick": cfg.quick,
        },
        pids=pids,
    )

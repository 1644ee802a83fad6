"""torch's own dynamic rendezvous in the scale benchmark, beside elastictk's, at the sizes it reaches.

What ``torchrun --rdzv-backend c10d`` runs: ``DynamicRendezvousHandler.from_backend`` over a
``C10dRendezvousBackend`` on a torch ``TCPStore`` client (multi-tenant, a 60 s read timeout),
``min_nodes = max_nodes = N``, torch's defaults otherwise (a random 0-0.3 s delay before a first
join, keep-alives every 5 s, a state re-read every second while waiting). The whole round is one
pickled state blob, base64 in one key, changed by compare-and-set: every join reads and writes
all of it, and every failed compare-and-set is redone.

The simulated nodes are threads in forked workers, as elastictk's are (``_rdzv_scale_fleet``),
against the same server (torch's c10d ``TCPStore`` in a process of its own,
``_rdzv_scale_store.start``). torch's handler holds the GIL for ``inspect.stack()`` at every
event it records, so it gets more workers than elastictk: :data:`PER_WORKER` nodes each, up to
:data:`MAX_WORKERS` workers (elastictk: 128 nodes to a worker), which favours torch. Each node's store is wrapped in a counting ``torch.distributed.Store`` (the
handler's rendezvous state and its bootstrap keys both go through it), so a join's calls and
bytes are counted as elastictk's are: keys and values as the client sends and receives them.

A case is bounded: a round that has not formed :attr:`cap` seconds after the start signal is
reported as not formed, with how many nodes had a rank by then and what the others had sent so
far; it is never dropped. Formation only: the steady state and a lost node are not run.
"""
from __future__ import annotations

import datetime
import math
import os
import threading
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

import psutil

from ._rdzv_scale_fleet import Workers

PER_WORKER = 16
MAX_WORKERS = 16  # past 256 nodes, more nodes to a worker rather than more processes
LABEL = "torch c10d"


def _counting_store(inner: Any) -> Any:
    """``inner`` (a torch ``TCPStore`` client) behind a ``torch.distributed.Store`` that counts
    calls and bytes; a torch ``PrefixStore`` over it (the handler's bootstrap keys) counts too."""
    import torch.distributed as dist

    def _len(x: Any) -> int:
        return len(x) if isinstance(x, (bytes, bytearray)) else len(str(x).encode())

    class Counting(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self.calls = self.bytes_out = self.bytes_in = self.waits = self.wakeups = 0

        def _n(self, out: int, inn: int = 0) -> None:
            self.calls += 1
            self.bytes_out += out
            self.bytes_in += inn

        def set(self, key: str, value: Any) -> None:
            inner.set(key, value)
            self._n(_len(key) + _len(value))

        def get(self, key: str) -> bytes:
            got = inner.get(key)
            self._n(_len(key), _len(got))
            return got

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            got = inner.compare_set(key, expected, desired)
            self._n(_len(key) + _len(expected) + _len(desired), _len(got))
            return got

        def add(self, key: str, value: int) -> int:
            got = inner.add(key, value)
            self._n(_len(key) + _len(value), _len(got))
            return got

        def check(self, keys: list[str]) -> bool:
            self._n(sum(_len(k) for k in keys))
            return inner.check(keys)

        def wait(self, keys: list[str], timeout: Any = None) -> None:
            self._n(sum(_len(k) for k in keys))
            self.waits += 1
            inner.wait(keys) if timeout is None else inner.wait(keys, timeout)
            self.wakeups += 1

        def delete_key(self, key: str) -> bool:
            self._n(_len(key))
            return inner.delete_key(key)

        def cost(self) -> dict[str, int]:
            return {"calls": self.calls, "bytes_out": self.bytes_out, "bytes_in": self.bytes_in,
                    "waits": self.waits, "wakeups": self.wakeups}

    return Counting()


class _Node:
    """One torch node: its own store client, backend and handler, built before the start signal."""

    def __init__(self, port: int, index: int, job: str, n: int, join_timeout: float) -> None:
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler, RendezvousTimeout,
        )

        self.index = index
        client = dist.TCPStore("127.0.0.1", port, is_master=False, multi_tenant=True,
                               timeout=datetime.timedelta(seconds=60))
        self.store = _counting_store(client)
        backend = C10dRendezvousBackend(self.store, job)  # one compare_set to create the key: setup
        self.handler = DynamicRendezvousHandler.from_backend(
            job, self.store, backend, min_nodes=n, max_nodes=n, local_addr="127.0.0.1",
            timeout=RendezvousTimeout(join=datetime.timedelta(seconds=join_timeout)))
        self.before: dict[str, int] = {}
        self.report: dict[str, Any] = {"index": index, "rank": None, "joined_at": None, "error": None}

    def join(self, go: threading.Event) -> None:
        go.wait()
        self.before = self.store.cost()
        try:
            info = self.handler.next_rendezvous()
            state = self.handler._state_holder.state  # private: read only to check the members agree
            self.report.update(rank=info.rank, world=info.world_size, round=state.round,
                               members=sorted(str(p) for p in state.participants),
                               node=str(self.handler._this_node), joined_at=time.monotonic())
        except Exception as e:  # noqa: BLE001 - reported, the case says which node failed how
            self.report["error"] = repr(e)[:300]

    def cost(self) -> dict[str, int]:
        now = self.store.cost()
        return {k: now[k] - self.before.get(k, 0) for k in now}


def _worker(conn: Connection, port: int, job: str, n: int, join_timeout: float, indices: list[int]) -> None:
    """A worker's command loop (in the forked process): build, join at a time, report, close."""
    threading.stack_size(512 * 1024)
    nodes: list[_Node] = []
    threads: list[threading.Thread] = []
    me = psutil.Process()
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "build":
                try:
                    nodes = [_Node(port, i, job, n, join_timeout) for i in indices]
                except Exception as e:  # noqa: BLE001 - the case reports it
                    conn.send(f"a node could not be built: {e!r}"[:300])
                else:
                    conn.send("ok")
            elif cmd == "join":
                go = threading.Event()
                threads = [threading.Thread(target=nd.join, args=(go,), daemon=True) for nd in nodes]
                for t in threads:
                    t.start()
                time.sleep(max(0.0, args[0] - time.monotonic()))
                go.set()
                conn.send("ok")
            elif cmd == "joined":  # the join threads, until the deadline; every node's report
                for t in threads:
                    t.join(max(0.0, args[0] - time.monotonic()))
                conn.send([{**nd.report, "cost": nd.cost()} for nd in nodes])
            elif cmd == "cpu":
                t = me.cpu_times()
                conn.send(t.user + t.system)
            elif cmd == "close":
                break
    finally:
        # Unfinished joins are threads inside torch's handler: they end with this process.
        try:
            conn.send("closed")
        except OSError:
            pass
        os._exit(0)


class _Fleet(Workers):
    def __init__(self, port: int, job: str, n: int, join_timeout: float) -> None:
        super().__init__(_worker, lambda mine: (port, job, n, join_timeout, mine), n,
                         min(MAX_WORKERS, max(1, math.ceil(n / PER_WORKER))), "elastictk-bench-c10d")

    def cpu(self) -> float:
        return float(sum(self.ask("cpu")))


def check_round(reports: list[dict[str, Any]], n: int) -> str | None:
    """What is wrong with a round every node joined (ranks, rounds, members), or None."""
    if sorted(r["rank"] for r in reports) != list(range(n)) or {r["world"] for r in reports} != {n}:
        return f"ranks are not 0..{n - 1} once each"
    if len({r["round"] for r in reports}) != 1:
        return "nodes ended in different rounds"
    if {tuple(r["members"]) for r in reports} != {tuple(sorted(r["node"] for r in reports))}:
        return "nodes disagree on the member list"
    return None


def run_case(n: int, cap: float, tmp: str, log: Any) -> dict[str, Any]:
    """torch's c10d rendezvous with ``n`` nodes, formation only, given ``cap`` seconds."""
    from ._rdzv_scale_join import per_join
    from ._rdzv_scale_store import start

    out: dict[str, Any] = {"backend": "c10d", "nodes": n, "form_cap_s": cap}
    try:
        server = start("tcp", tmp)
    except (RuntimeError, OSError) as e:
        return {**out, "error": f"{LABEL} with {n} nodes: {e}"}
    fleet: _Fleet | None = None
    try:
        t = time.monotonic()
        fleet = _Fleet(int(server.endpoint.rsplit(":", 1)[1]), f"scale-c10d-{n}-{uuid.uuid4().hex[:8]}", n,
                       join_timeout=cap + 600)
        built = [a for a in fleet.ask("build") if a != "ok"]
        if built:
            return {**out, "error": f"{LABEL} with {n} nodes: {built[0]}"}
        out["setup_s"] = round(time.monotonic() - t, 3)
        out["client_processes"] = len(fleet.procs)
        me0, cpu0 = fleet.cpu(), server.cpu_seconds()
        t0 = time.monotonic() + 0.2
        fleet.ask("join", t0)
        reports = [r for rs in fleet.ask("joined", t0 + cap, timeout=cap + 90) for r in rs]
        out["form_nodes_cpu_s"] = round(fleet.cpu() - me0, 3)
        out["form_server_cpu_s"] = round(server.cpu_seconds() - cpu0, 3)
        joined = [r for r in reports if r["joined_at"] is not None]
        errors = [r for r in reports if r["error"] is not None]
        out["ranked"] = len(joined)
        if errors:
            out["error"] = f"{LABEL} with {n} nodes: {len(errors)} node(s) failed, the first: {errors[0]['error']}"
        elif len(joined) < n:
            out.update(form_s=None, form_first_rank_s=None,
                       form_note=f"did not form within {cap:g} s ({len(joined)} of {n:,} nodes had a rank)")
            out["form_join_unfinished"] = per_join([r["cost"] for r in reports if r["joined_at"] is None])
        elif (wrong := check_round(reports, n)) is not None:
            out["error"] = f"{LABEL} with {n} nodes: {wrong}"
        else:
            out["form_s"] = round(max(r["joined_at"] for r in joined) - t0, 4)
            out["form_first_rank_s"] = round(min(r["joined_at"] for r in joined) - t0, 4)
        if joined:
            out["form_join"] = per_join([r["cost"] for r in joined])
        j = out.get("form_join") or out.get("form_join_unfinished") or {}
        log(f"  {LABEL} {n:5d} nodes: " + (out.get("error") or out.get("form_note")
                                           or f"formed in {out['form_s']:.3f}s (setup {out['setup_s']:.1f}s)")
            + f"; per join {j.get('calls', {}).get('median')} calls, {j.get('bytes', {}).get('median')} B (median)")
        return out
    except (TimeoutError, EOFError, OSError, RuntimeError) as e:  # a worker or the server gone
        return {**out, "error": f"{LABEL} with {n} nodes: {e!r}"[:400]}
    finally:
        if fleet is not None:
            fleet.close()
        server.close()


NOTE = (
    "torch c10d: torch.distributed.elastic's DynamicRendezvousHandler over C10dRendezvousBackend, what "
    "torchrun --rdzv-backend c10d runs (bench/_rdzv_scale_c10d.py), on the same TCPStore server, with "
    "torch's defaults; its nodes are threads in forked workers, 16 to a worker where elastictk has 128 (its "
    "handler holds the GIL for inspect.stack() at every event it records), which favours torch; formation "
    "only, bounded by a cap per size; a join's calls and bytes are counted on the node's own store as "
    "elastictk's are; the whole round is one base64 pickle under compare-and-set, so every join reads and "
    "writes all of it and every waiting node re-reads it each second"
)

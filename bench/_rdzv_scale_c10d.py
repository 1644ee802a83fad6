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
import multiprocessing
import os
import threading
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

import psutil

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


class _Fleet:
    def __init__(self, port: int, job: str, n: int, join_timeout: float) -> None:
        ctx = multiprocessing.get_context("fork")
        k = min(MAX_WORKERS, max(1, math.ceil(n / PER_WORKER)))
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        for w in range(k):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(theirs, port, job, n, join_timeout, list(range(w, n, k))),
                            daemon=True, name=f"elastictk-bench-c10d-{w}")
            p.start()
            theirs.close()
            self.pipes.append(mine)
            self.procs.append(p)

    def ask(self, *cmd: Any, timeout: float = 600) -> list[Any]:
        for c in self.pipes:
            c.send(cmd)
        out = []
        for c, p in zip(self.pipes, self.procs):
            if not c.poll(timeout):
                raise TimeoutError(f"worker {p.name} did not answer {cmd[0]!r} within {timeout:g}s")
            out.append(c.recv())
        return out

    def cpu(self) -> float:
        return float(sum(self.ask("cpu")))

    def close(self) -> None:
        for c in self.pipes:
            try:
                c.send(("close",))
            except OSError:
                pass
        for c, p in zip(self.pipes, self.procs):
            try:
                c.poll(30) and c.recv()
            except (OSError, EOFError):
                pass
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
            c.close()


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

    server = start("tcp", tmp)
    fleet: _Fleet | None = None
    out: dict[str, Any] = {"backend": "c10d", "nodes": n, "form_cap_s": cap}
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


# -- beside elastictk: pure functions of the measured cases ------------------------------------
def _pair(cases: list[dict[str, Any]], n: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    pick = {(c.get("backend"), c.get("nodes")): c for c in cases}
    return pick.get(("tcp", n)), pick.get(("c10d", n))


def _median(c: dict[str, Any], field: str) -> float | None:
    j = c.get("form_join") if c.get("form_s") is not None else c.get("form_join_unfinished")
    return None if not j or field not in j else float(j[field]["median"])


def _x(theirs: float, ours: float, at_least: bool) -> str:
    if ours <= 0:
        return "—"
    r = theirs / ours
    return f"{'≥ ' if at_least else ''}×{r:,.0f}" if r >= 100 else f"{'≥ ' if at_least else ''}×{r:.3g}"


def compare(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per size torch's c10d rendezvous was run at: its formation time and per-join
    calls and bytes (median node) beside elastictk's on TCPStore (the same server), and the
    ratios where both were measured; ``at_least`` where c10d did not form within its cap (its
    time is then the cap, its bytes those its unfinished joins had sent: lower bounds)."""
    rows = []
    for n in sorted({int(c["nodes"]) for c in cases if c.get("backend") == "c10d"}):
        ours, theirs = _pair(cases, n)
        assert theirs is not None
        row: dict[str, Any] = {"nodes": n, "etk_form_s": None, "c10d_form_s": theirs.get("form_s"),
                               "c10d_state": "failed" if "error" in theirs else
                               ("formed" if theirs.get("form_s") is not None else "not formed"),
                               "cap_s": theirs.get("form_cap_s"), "at_least": theirs.get("form_s") is None,
                               "c10d_calls": _median(theirs, "calls"), "c10d_bytes": _median(theirs, "bytes")}
        if ours is not None and "error" not in ours and ours.get("form_s") is not None:
            row.update(etk_form_s=ours["form_s"], etk_calls=_median(ours, "calls"), etk_bytes=_median(ours, "bytes"))
        rows.append(row)
    return rows


def beside_verdict(cases: list[dict[str, Any]]) -> Any:
    """elastictk on TCPStore forms sooner and moves fewer bytes per join (median node) than
    torch's c10d rendezvous at every size both were measured; a c10d round that did not form
    within its cap counts at the cap (elastictk must have formed sooner than that)."""
    from ._rdzv_scale_fit import Verdict

    target = ("elastictk on TCPStore forms sooner than torch's c10d rendezvous and moves fewer "
              "bytes per join (median node), at every size both were run")
    judged, parts, ok = 0, [], True
    for r in compare(cases):
        n = f"{r['nodes']:,}"
        if r["c10d_state"] == "failed" or r["etk_form_s"] is None:
            parts.append(f"{n}: not compared ({'c10d failed' if r['c10d_state'] == 'failed' else 'no elastictk round'})")
            continue
        t_theirs = r["c10d_form_s"] if r["c10d_form_s"] is not None else r["cap_s"]
        b_ours, b_theirs = r.get("etk_bytes"), r.get("c10d_bytes")
        judged += 1
        sooner = r["etk_form_s"] < t_theirs
        fewer = b_ours is not None and b_theirs is not None and b_ours < b_theirs
        ok = ok and sooner and fewer
        parts.append(f"{n}: {r['etk_form_s']:.3g} s vs {'≥ ' if r['at_least'] else ''}{t_theirs:.3g} s, "
                     f"{b_ours or 0:,.0f} B vs {'≥ ' if r['at_least'] else ''}{b_theirs or 0:,.0f} B")
    if not judged:
        return Verdict(target, "; ".join(parts) or "torch's c10d rendezvous was not run", None)
    return Verdict(target, "; ".join(parts), ok)


def markdown(cases: list[dict[str, Any]]) -> list[str]:
    """The side-by-side table (and the unfinished joins' costs where c10d did not form)."""
    rows = compare(cases)
    if not rows:
        return []
    lines = ["## elastictk beside torch's c10d rendezvous (the same TCPStore server)", "",
             "| nodes | elastictk formed | c10d formed | c10d / elastictk | per join, elastictk: calls, bytes "
             "| per join, c10d: calls, bytes | bytes c10d / elastictk |", "|" + "---|" * 7]
    for r in rows:
        ours = "—" if r["etk_form_s"] is None else f"{r['etk_form_s']:.3g} s"
        if r["c10d_state"] == "failed":
            theirs, ratio = "failed (see above)", "—"
        elif r["c10d_state"] == "not formed":
            theirs = f"did not form within {r['cap_s']:g} s"
            ratio = "—" if r["etk_form_s"] is None else _x(r["cap_s"], r["etk_form_s"], True)
        else:
            theirs = f"{r['c10d_form_s']:.3g} s"
            ratio = "—" if r["etk_form_s"] is None else _x(r["c10d_form_s"], r["etk_form_s"], False)

        def cost(calls: float | None, nbytes: float | None, lower: bool) -> str:
            return "—" if calls is None or nbytes is None else f"{'≥ ' if lower else ''}{calls:g}, {nbytes:,.0f} B"
        bx = "—"
        if r.get("etk_bytes") and r["c10d_bytes"] is not None:
            bx = _x(r["c10d_bytes"], r["etk_bytes"], r["at_least"])
        lines.append(f"| {r['nodes']:,} | {ours} | {theirs} | {ratio} | {cost(r.get('etk_calls'), r.get('etk_bytes'), False)} "
                     f"| {cost(r['c10d_calls'], r['c10d_bytes'], r['at_least'])} | {bx} |")
    lines += ["", "Where c10d did not form, its time is at least the cap and its per-join figures are what "
              "its unfinished joins had sent by then (median node): lower bounds (≥)."]
    return lines


def unfinished_rows(cases: list[dict[str, Any]]) -> list[str]:
    """Rows for the per-join table: what a c10d round's unfinished joins had sent at its cap."""
    out = []
    for c in cases:
        j = c.get("form_join_unfinished")
        if j:
            def cell(f: str) -> str:
                return "—" if f not in j else f"≥ {j[f]['median']:,.0f} / {j[f]['max']:,.0f}"
            out.append(f"| {LABEL} | {c['nodes']:,} | form, unfinished at the {c['form_cap_s']:g} s cap "
                       f"| {cell('calls')} | {cell('bytes')} | {cell('waits')} | {cell('wakeups')} | — |")
    return out


NOTE = (
    "torch c10d: torch.distributed.elastic's DynamicRendezvousHandler over C10dRendezvousBackend, what "
    "torchrun --rdzv-backend c10d runs (bench/_rdzv_scale_c10d.py), on the same TCPStore server, with "
    "torch's defaults; its nodes are threads in forked workers, 16 to a worker where elastictk has 128 (its "
    "handler holds the GIL for inspect.stack() at every event it records), which favours torch; formation "
    "only, bounded by a cap per size; a join's calls and bytes are counted on the node's own store as "
    "elastictk's are; the whole round is one base64 pickle under compare-and-set, so every join reads and "
    "writes all of it and every waiting node re-reads it each second"
)

"""The simulated nodes of one case, spread over forked worker processes.

Each worker hosts up to ``PER_WORKER`` nodes as threads (``_rdzv_scale_nodes.SimNode``); the
benchmark drives them all through one command pipe per worker. Why processes at all: a node is
five threads (its join or re-form, heartbeat, membership watch and fence, failure watch,
straggler records), and threads under one GIL that wake together spend their time handing it
over (futex calls, which this sandbox's kernel makes slow) instead of talking to the store.
Why sixteen, not the 128 this harness began with: a lost node wakes every survivor at once, and
with 128 nodes (640 threads) to an interpreter the threads queued for its GIL woke every 5 ms to
ask for it (hundreds runnable, a load average of 300 on 2 cores), so the store's own process got
2-9 % of a core and the survivors' watches fired 4 to 23 s apart (1,024 nodes: re-formed 5.0,
7.3, 12.5 s after the loss was noticed, one run in three failing); with 16 (64 workers at 1,024)
they fire within 1 s and the round re-forms in 1.5-1.6 s (three runs). A real node has an
interpreter of its own: fewer nodes per interpreter is closer to it, not kinder.
Times are ``time.monotonic()``, one clock for all processes of the machine.
"""
from __future__ import annotations

import hashlib
import math
import multiprocessing
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

import psutil

from elastictk.rendezvous import RendezvousConfig

PER_WORKER = 16


@dataclass(frozen=True)
class NodeReport:
    """One node after a join: where it stands, and when."""

    index: int
    node_id: str
    round: int | None
    rank: int | None
    world: int | None
    members: str | None  # a digest of the member list
    joined_at: float | None
    noticed_at: float | None
    error: str | None
    cost: dict[str, int] | None = None  # of its last join (SimNode.join)


def _digest(ids: list[str]) -> str:
    return hashlib.sha1("\n".join(sorted(ids)).encode()).hexdigest()[:16]


MEMBER_SAMPLE = 2  # nodes per worker whose member list is read back and compared


def _report(nd: Any, members: bool) -> NodeReport:
    """Where ``nd`` stands. ``members``: also read its round's member list (O(N) from the store,
    as no node of the protocol does): a sample of nodes, asked after every worker's nodes have
    joined, so reading it back loads no store a node still joins through."""
    i = nd.info
    return NodeReport(nd.index, nd.node_id, None if i is None else i.round, None if i is None else i.rank,
                      None if i is None else i.world_size,
                      None if i is None or not members else _digest([m.node_id for m in i.members]),
                      nd.joined_at, nd.noticed_at, None if nd.error is None else repr(nd.error)[:300],
                      nd.cost)


def _worker(conn: Connection, backend: str, endpoint: str, cfg: RendezvousConfig, indices: list[int]) -> None:
    """A worker's command loop (in the forked process)."""
    from ._rdzv_scale_nodes import SimNode, in_threads
    from ._rdzv_scale_store import Tally, connect

    threading.stack_size(512 * 1024)
    tally = Tally()

    class _At:  # what SimNode needs of a server
        def connect(self, t: Tally, meter: Any = None) -> Any:
            return connect(backend, endpoint, t, meter)

    nodes: list[SimNode] = []
    threads: list[threading.Thread] = []
    me = psutil.Process()
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "build":
                with ThreadPoolExecutor(16) as pool:  # connecting is not timed
                    nodes = list(pool.map(lambda i: SimNode(_At(), tally, cfg, i), indices))  # type: ignore[arg-type]
                conn.send("ok")
            elif cmd == "join":  # at monotonic time args[0], all nodes at once
                go = threading.Event()
                threads = in_threads(nodes, "join", go=go)
                time.sleep(max(0.0, args[0] - time.monotonic()))
                go.set()
                conn.send("ok")
            elif cmd == "joined":  # wait for the join (or re-form) threads; report every node
                for t in threads:
                    t.join(max(0.0, args[0] - time.monotonic()))
                conn.send([_report(nd, False) for nd in nodes if nd.index != args[1]])
            elif cmd == "members":  # every worker answered "joined": a sample reads its member list
                sample = [nd for nd in nodes if nd.index != args[0] and nd.info is not None][:MEMBER_SAMPLE]
                conn.send([_report(nd, True) for nd in sample])
            elif cmd == "run":
                with ThreadPoolExecutor(16) as pool:  # each opens two connections
                    list(pool.map(lambda nd: nd.run_round(), nodes))
                conn.send("ok")
            elif cmd == "tally":
                t = me.cpu_times()
                conn.send((tally.snapshot(), t.user + t.system))
            elif cmd == "kill":
                for nd in nodes:
                    if nd.index == args[0]:
                        nd.die()
                conn.send("ok")
            elif cmd == "reform":  # every node but the dead one: notice, stop, join anew
                deadline, min_nodes, dead = args
                threads = in_threads([nd for nd in nodes if nd.index != dead], "reform", deadline, min_nodes)
                conn.send("ok")
            elif cmd == "close":
                break
    finally:
        # The job is over: its sockets and threads end with this process. A graceful stop of
        # a thousand threads on two cores costs minutes and measures nothing.
        try:
            conn.send("closed")
        except OSError:
            pass
        os._exit(0)


class Workers:
    """Forked worker processes, each holding every k-th of ``n`` simulated nodes, driven by
    commands over pipes: what elastictk's fleet and the c10d fleet beside it share."""

    def __init__(self, target: Callable[..., None], args: Callable[[list[int]], tuple[Any, ...]],
                 n: int, k: int, name: str) -> None:
        ctx = multiprocessing.get_context("fork")
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        for w in range(k):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=target, args=(theirs, *args(list(range(w, n, k)))),
                            daemon=True, name=f"{name}-{w}")
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


class Fleet(Workers):
    """``n`` simulated nodes in ``ceil(n / PER_WORKER)`` forked workers."""

    def __init__(self, backend: str, endpoint: str, cfg: RendezvousConfig, n: int) -> None:
        super().__init__(_worker, lambda mine: (backend, endpoint, cfg, mine), n,
                         max(1, math.ceil(n / PER_WORKER)), "elastictk-bench-scale")

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.procs]

    def reports(self, deadline: float, dead: int = -1) -> list[NodeReport]:
        # A worker answers once its deadline has passed; one whose threads are still busy
        # (a thousand nodes on two cores) gets a minute more to be heard.
        out = [r for rs in self.ask("joined", deadline, dead, timeout=deadline - time.monotonic() + 90) for r in rs]
        read = {r.index: r for rs in self.ask("members", dead) for r in rs}
        return [read.get(r.index, r) for r in out]

    def tally(self) -> tuple[Counter[str], float]:
        calls: Counter[str] = Counter()
        cpu = 0.0
        for c, s in self.ask("tally"):
            calls += c
            cpu += s
        return calls, cpu

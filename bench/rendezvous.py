"""Rendezvous: K node processes form one round over a TCPStore, elastictk vs torch.

A job re-forms after every failure and every scale event, so the time a rendezvous takes is
time every node of the job sits idle. Here K simulated nodes, each its own process with its own
store client, join one round with ``min_nodes = max_nodes = K``:

- elastictk ``RendezvousHandler(store, RendezvousConfig(...)).next_round()`` over elastictk's
  ``TCPStore``, twice: as is (``next_round`` starts the node's heartbeat, which opens a store
  connection of its own), and with ``start_heartbeat()`` called during setup, as an agent can
  while it prepares its workers;
- torch ``DynamicRendezvousHandler.from_backend(..., C10dRendezvousBackend, ...)``
  ``.next_rendezvous()`` over torch's ``TCPStore``: what ``torchrun --rdzv-backend=c10d`` runs.

A sample is the time from one start signal, given to all K nodes at once, until the LAST node
has its rank. Connecting the store clients and building the handlers happens before the signal
and is not timed. Every repetition gets a fresh store server (its own process) and a fresh job
id, and is checked: ranks 0..K-1 each exactly once, every node in the same round with world
size K and the same member list. The node processes are forked from this process, which imported
torch and elastictk once (see ``bench/_forked.py``).

Both sides use the same server: torch's c10d ``TCPStore`` (libuv), listening on an IPv4 socket
(see ``_server``). elastictk heartbeats every 1 s (timeout 10 s); torch keeps its defaults
(keep-alive every 5 s, 3 attempts, a random 0-0.3 s delay before a first join, 1 s between
state polls). Both get the node address 127.0.0.1, so neither looks up the host name.

``python -m bench rendezvous --scale`` goes past a rack: 8 to 1,024 simulated nodes (threads,
not processes) against a real TCPStore and etcd, with the formation time, the steady-state load
on the store and the time to re-form after a lost node (``bench/_rdzv_scale.py``).
"""
from __future__ import annotations

import datetime
import hashlib
import os
import statistics
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Callable

from . import _forked
from .common import BenchError, BenchResult, Comparison, Measured, RunConfig, raise_fd_limit

TITLE = "Rendezvous: K node processes form one round, elastictk vs torch"


@dataclass(frozen=True)
class Plan:
    """How often to run each side for one K, and when to give up on a round."""

    k: int
    ours_reps: int
    ref_reps: int
    ours_timeout: float
    ref_timeout: float


# torch's time for K >= 32 swings from seconds to minutes with the machine's load (see
# TORCH_NOTE), so it gets fewer repetitions there, each capped: the whole benchmark stays
# around ten minutes.
FULL = (
    Plan(2, 7, 5, 60, 60),
    Plan(8, 7, 5, 60, 60),
    Plan(32, 5, 3, 60, 60),
    Plan(64, 5, 3, 60, 60),
    Plan(128, 3, 1, 60, 90),
    Plan(256, 3, 1, 60, 90),
)
QUICK = (  # a smoke run: torch is cut off after 10 s, which it needs only on a loaded machine
    Plan(2, 1, 1, 30, 10),
    Plan(8, 1, 1, 30, 10),
)


TORCH_NOTE = (
    "why torch slows down with K on this machine (from stack dumps of its nodes): each event "
    "its handler records calls inspect.stack() twice to name itself, tens to hundreds of "
    "milliseconds of CPU, and it records several per state change, between reading the "
    "shared state and compare-and-setting it back; with K processes on few cores most "
    "compare-and-sets fail and are redone, and a node whose keep-alive in the state is 15 s "
    "old is dropped from it, so from K=32 on a round takes seconds to minutes depending on "
    "the machine's load"
)


def _digest(node_ids: list[str]) -> str:
    return hashlib.sha1("\n".join(sorted(node_ids)).encode()).hexdigest()[:16]


# -- inside the forked processes ---------------------------------------------------------------
def _server() -> tuple[int, object]:
    """torch's c10d ``TCPStore`` server (libuv), as ``elastictk.store.TCPStore.serve`` and
    torch's c10d rendezvous backend both host it, but on an IPv4 listening socket.

    Bound to ``::`` (its default), the server formats every accepted peer, ``::ffff:127.0.0.1``,
    with a reverse-DNS lookup on its one event-loop thread; where the resolver is slow (this
    sandbox's answers some lookups only after its 5 s timeout) that stalls every client of
    the store at once. An IPv4 peer resolves from /etc/hosts.
    """
    import socket

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    port = sock.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60), use_libuv=True,
                           master_listen_fd=sock.detach())
    return port, server


class _EtkNode:
    """An elastictk node; ``early`` starts its heartbeat (and so opens the heartbeat's own
    store connection) during setup, as an agent can while it prepares its workers."""

    def __init__(self, port: int, index: int, job: str, k: int, timeout: float,
                 early: bool) -> None:
        from elastictk.rendezvous import RendezvousConfig, RendezvousHandler
        from elastictk.store.tcp import TCPStore

        self.store = TCPStore.connect(f"127.0.0.1:{port}", timeout=timeout)
        cfg = RendezvousConfig(job, min_nodes=k, max_nodes=k, last_call=30.0,
                               join_timeout=timeout, heartbeat_interval=1.0,
                               heartbeat_timeout=10.0)
        self.node_id = f"node{index}-{os.getpid()}"
        self.handler = RendezvousHandler(self.store, cfg, node_id=self.node_id,
                                         meta={"addr": "127.0.0.1", "index": index})
        self.hb_connect_s = self._start_heartbeat() if early else 0.0

    def _start_heartbeat(self) -> float:
        t0 = time.monotonic()
        self.handler.start_heartbeat()
        return time.monotonic() - t0

    def join(self) -> dict[str, Any]:
        # next_round() starts the heartbeat first thing; doing it here is the same call,
        # timed on its own to show what the connection costs.
        if not self.hb_connect_s:
            self.hb_connect_s = self._start_heartbeat()
        info = self.handler.next_round()
        return {"node": self.node_id, "rank": info.rank, "world_size": info.world_size,
                "round": info.round, "members": _digest([m.node_id for m in info.members]),
                "hb_connect_s": self.hb_connect_s}

    def close(self) -> None:
        self.handler.close()
        self.store.close()


class _TorchNode:
    def __init__(self, port: int, index: int, job: str, k: int, timeout: float) -> None:
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            C10dRendezvousBackend,
        )
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler, RendezvousTimeout,
        )

        # A client as torch's c10d backend opens it (its read timeout: 60 s by default).
        store = dist.TCPStore("127.0.0.1", port, is_master=False, multi_tenant=True,
                              timeout=datetime.timedelta(seconds=60))
        backend = C10dRendezvousBackend(store, job)
        self.handler = DynamicRendezvousHandler.from_backend(
            job, store, backend, min_nodes=k, max_nodes=k, local_addr="127.0.0.1",
            timeout=RendezvousTimeout(join=datetime.timedelta(seconds=timeout)),
        )

    def join(self) -> dict[str, Any]:
        info = self.handler.next_rendezvous()
        # Private state, read only to check that every node agrees on the membership.
        state = self.handler._state_holder.state
        return {"node": str(self.handler._this_node), "rank": info.rank,
                "world_size": info.world_size, "round": state.round,
                "members": _digest([str(n) for n in state.participants])}

    def close(self) -> None:
        self.handler._stop_heartbeats()  # leave without closing the job for the others


# -- in the benchmark process ------------------------------------------------------------------
@dataclass(frozen=True)
class Subject:
    key: str
    label: str
    node: Callable[[int, int, str, int, float], _forked.Node]
    ours: bool


SUBJECTS = (
    Subject("etk", "RendezvousHandler",
            lambda *a: _EtkNode(*a, early=False), True),
    Subject("etk-early", "RendezvousHandler, start_heartbeat() in setup",
            lambda *a: _EtkNode(*a, early=True), True),
    Subject("torch", "torch DynamicRendezvousHandler (c10d)", _TorchNode, False),
)
REF = SUBJECTS[-1]


def _check(label: str, k: int, run: _forked.RoundRun) -> None:
    """The round is right, or the sample does not count: no benchmark passes by being wrong."""
    res = run.results
    where = f"{label} with K={k}"
    ranks = sorted(r["rank"] for r in res)
    if ranks != list(range(k)):
        raise BenchError(f"{where}: ranks {ranks[:10]}... are not 0..{k - 1} once each")
    sizes = {r["world_size"] for r in res}
    if sizes != {k}:
        raise BenchError(f"{where}: nodes disagree on the world size: {sorted(sizes)}")
    if len({r["round"] for r in res}) != 1:
        raise BenchError(f"{where}: nodes ended in different rounds")
    nodes = [r["node"] for r in res]
    if len(set(nodes)) != k:
        raise BenchError(f"{where}: {k - len(set(nodes))} node ids are not unique")
    if {r["members"] for r in res} != {_digest(nodes)}:
        raise BenchError(f"{where}: nodes disagree on the member list")


def _sample(sub: Subject, plan: Plan, cfg: RunConfig, extra: dict[str, list[Any]],
            pids: list[int]) -> float:
    timeout = plan.ours_timeout if sub.ours else plan.ref_timeout
    job = f"bench-{sub.key}-{plan.k}-{uuid.uuid4().hex[:8]}"

    def node(port: int, index: int) -> _forked.Node:
        return sub.node(port, index, job, plan.k, timeout + 30)

    run = _forked.run_round(plan.k, _server, node, setup_timeout=60 + plan.k * 0.5,
                            round_timeout=timeout)
    pids += run.pids
    if run.timed_out:
        cfg.log(f"    {sub.label} K={plan.k}: {len(run.results)} of {plan.k} nodes had a rank "
                f"after {timeout:g}s; stopped (timed out)")
    else:
        _check(sub.label, plan.k, run)
        cfg.log(f"    {sub.label} K={plan.k}: {run.elapsed:.3f}s (setup {run.setup_s:.1f}s)")
    extra["timed_out"].append(run.timed_out)
    extra["first_rank_s"].append(round(run.first, 4))
    extra["ranked_nodes"].append(len(run.results))
    extra["setup_s"].append(round(run.setup_s, 3))
    if sub.ours:
        slowest = max((r["hb_connect_s"] for r in run.results), default=0.0)
        extra["slowest_heartbeat_connect_s"].append(round(slowest, 4))
    return run.elapsed


def _case(plan: Plan, cfg: RunConfig, pids: list[int]) -> list[Comparison]:
    """Interleaved: A B C, C B A, ... until each subject has its repetitions."""
    samples: dict[str, list[float]] = {s.key: [] for s in SUBJECTS}
    extras: dict[str, dict[str, list[Any]]] = {
        s.key: {"timed_out": [], "first_rank_s": [], "ranked_nodes": [], "setup_s": [],
                **({"slowest_heartbeat_connect_s": []} if s.ours else {})}
        for s in SUBJECTS
    }
    want = {s.key: plan.ours_reps if s.ours else plan.ref_reps for s in SUBJECTS}
    for r in range(max(want.values())):
        for sub in SUBJECTS if r % 2 == 0 else SUBJECTS[::-1]:
            if len(samples[sub.key]) < want[sub.key]:
                samples[sub.key].append(_sample(sub, plan, cfg, extras[sub.key], pids))
    def cut(sub: Subject) -> str:
        n = sum(extras[sub.key]["timed_out"])
        cap = plan.ours_timeout if sub.ours else plan.ref_timeout
        if not n:
            return ""
        who = "elastictk" if sub.ours else "torch"
        return (f"{who} did not finish within {cap:g} s in {n} of {len(samples[sub.key])} "
                f"repetition(s) with K={plan.k}: such a sample counts as {cap:g} s, so the real "
                "time is longer")

    ref = Measured(REF.label, samples[REF.key], extras[REF.key])
    return [
        Comparison({"nodes": str(plan.k)}, Measured(s.label, samples[s.key], extras[s.key]),
                   ref, "; ".join(note for note in (cut(s), cut(REF)) if note))
        for s in SUBJECTS if s.ours
    ]


def _connect_note(rows: list[Comparison]) -> str:
    """What opening the heartbeat's store connection cost, measured in the same run."""
    inside = [x for row in rows if row.ours.label == SUBJECTS[0].label
              for x in row.ours.extra["slowest_heartbeat_connect_s"]]
    if not inside:
        return ""
    slow = sum(x >= 1.0 for x in inside)
    note = (
        "opening the heartbeat's store connection (`start_heartbeat()`, the first step of "
        f"`next_round`) took the slowest node of an as-is round up to {max(inside):.2f} s "
        f"(median {statistics.median(inside):.3f} s), time the as-is elastictk rounds include"
    )
    if slow:
        note += (
            f"; it took a second or more in {slow} of {len(inside)} rounds: a c10d client "
            "looks up its socket's host name as it connects, and this machine's resolver "
            "answers some of those lookups only after a 5 s timeout"
        )
    return note


def run(cfg: RunConfig) -> BenchResult:
    plans = QUICK if cfg.quick else FULL
    # Import both sides once, here: every forked node and server inherits them.
    import torch.distributed  # noqa: F401
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous  # noqa: F401

    import elastictk.rendezvous  # noqa: F401
    import elastictk.store.tcp  # noqa: F401

    # Each node holds a few pipes and sockets and the server one socket per client.
    fd_limit = raise_fd_limit(16 * max(p.k for p in plans) + 1024)
    rows: list[Comparison] = []
    pids: list[int] = []
    t0 = time.monotonic()
    for plan in plans:
        cfg.log(f"  K={plan.k}: {plan.ours_reps} elastictk and {plan.ref_reps} torch "
                "repetitions, interleaved ...")
        rows += _case(plan, cfg, pids)
    return BenchResult(
        name="rendezvous",
        title=TITLE,
        description=(__doc__ or "").split("\n", 1)[1].strip(),
        unit="s",
        higher_is_better=False,
        rows=rows,
        notes=[note for note in [
            f"nodes are processes; with {os.cpu_count()} cores here, K nodes share them, so "
            "large K measures how a rendezvous copes with contention, as a big job's store does",
            _connect_note(rows),
            TORCH_NOTE,
            "fewer torch repetitions at large K, each capped: it takes seconds to minutes there",
            f"the whole benchmark took {time.monotonic() - t0:.0f} s",
        ] if note],
        params={
            "plans": [asdict(p) for p in plans], "quick": cfg.quick,
            "open_files_limit": fd_limit,
        },
        pids=pids,
    )

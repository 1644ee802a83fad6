"""Run one multi-node job (N agents on loopback, see :mod:`.cluster`) under a fault plan and
record what happened, in the same :class:`RunRecord` a single-node run fills.

Besides the worker faults of a single node, two faults only make sense here:

- ``kill-agent on node:N``: SIGKILL node N's agent; its workers die with it (death signal).
  With ``rejoin_s`` the node's agent is started again that many seconds later, so the job
  scales back up.
- ``store-outage:<s> on store``: SIGSTOP the store's process for ``s`` seconds, then SIGCONT:
  the etcd server, or under c10d node 0's agent, which hosts the TCPStore (its workers keep
  running; they talk over their own process group, not over the rendezvous store).

Time faults count from the moment workers first run on every node (agents start at the speed
of the machine, and a kill before the first round would hit a spare, not a member), or, if the
job never reaches its full size, from ``FULL_SIZE_WAIT`` seconds after every agent is up (its
``rendezvous_started``, or it exited): not after the run's start, since an agent's own start-up
takes a minute on a loaded host, and a fault timed from the start would hit an agent still
importing torch.

Worker faults find their PIDs through the agents' event logs: ``round_joined`` gives each
agent's group rank, ``workers_started`` its workers' PIDs by local rank, so global rank
``group_rank * nproc_per_node + local_rank`` maps to a PID on whichever node runs it now.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from ..faults import FaultPlan
from ..faults.env import private_site
from ..metrics.events import read_events
from .cluster import Cluster
from .leaks import _listening, _shm, record_leaks
from .outside import OUTSIDE_SIGNALS, _descendants, late
from .record import Injection, RunRecord, read_fault_log, read_worker_records
from .runner import STEP_LINE, fault_env, fresh_log, stop_requested, stopped_by

FULL_SIZE_WAIT = 60.0


def tag_events(per_node: Iterable[tuple[int, list[Any]]]) -> list[Any]:
    """The events of every agent in one list by time, each with ``fields["node"]`` set to the
    index of the node that wrote it (monotonic time is one clock for every process here)."""
    out = [dataclasses.replace(e, fields={**e.fields, "node": node}) for node, evs in per_node for e in evs]
    return sorted(out, key=lambda e: e.mono)


def workers_by_rank(events: Sequence[Any], nproc: int) -> dict[int, tuple[int, int]]:
    """Global rank → (node, PID) of the workers each node started last (tagged events)."""
    group: dict[int, int] = {}
    pids: dict[int, dict[int, int]] = {}
    for e in events:
        node = e.fields.get("node")
        if e.kind == "round_joined":
            group[node] = int(e.fields.get("rank", 0))
        elif e.kind == "workers_started":
            pids[node] = {int(k): int(v) for k, v in (e.fields.get("pids") or {}).items()}
        elif e.kind == "workers_stopped":
            pids.pop(node, None)
    out = {}
    for node, local in pids.items():
        if node in group:
            for lr, pid in local.items():
                out[group[node] * nproc + lr] = (node, pid)
    return out


def full_size_at(events: Sequence[Any], world: int, nodes: int) -> Optional[float]:
    """When workers first ran on every node: the moment the last of ``nodes`` nodes logged a
    ``workers_started`` of the full world size (tagged events, by time)."""
    seen: set[Any] = set()
    for e in events:
        if e.kind == "workers_started" and int(e.fields.get("world_size", 0)) == world:
            seen.add(e.fields.get("node"))
            if len(seen) >= nodes:
                return float(e.mono)
    return None


def agents_up_at(events: Sequence[Any], nodes: int, exited: Iterable[int] = ()) -> Optional[float]:
    """When the last of ``nodes`` agents got past its start-up (its first ``rendezvous_started``,
    tagged events, by time); nodes in ``exited`` count as up from the first event on."""
    seen: set[Any] = set(exited)
    if len(seen) >= nodes:
        return float(events[0].mono) if events else 0.0
    for e in events:
        if e.kind == "rendezvous_started":
            seen.add(e.fields.get("node"))
            if len(seen) >= nodes:
                return float(e.mono)
    return None


def run_nodes(plan: Optional[FaultPlan], launcher_flags: Sequence[str], command: Sequence[str],
              out_dir: Path, *, nodes: int, backend: str, nproc: int, timeout: float,
              rejoin_s: Optional[float] = None,
              progress: Optional[Callable[[RunRecord], None]] = None, tag: str = "chaos",
              auto_steps: bool = True) -> RunRecord:
    """Run the job on ``nodes`` agents to its end (or ``timeout``), injecting ``plan``; the
    workers' sitecustomize lives in a private temporary directory for the run's length."""
    with contextlib.ExitStack() as stack:
        site = stack.enter_context(private_site()) if plan is not None and auto_steps else None
        return _run_nodes(plan, launcher_flags, command, out_dir, nodes=nodes, backend=backend,
                          nproc=nproc, timeout=timeout, rejoin_s=rejoin_s, progress=progress, tag=tag,
                          auto_steps=auto_steps, site=site)


def _run_nodes(plan: Optional[FaultPlan], launcher_flags: Sequence[str], command: Sequence[str],
               out_dir: Path, *, nodes: int, backend: str, nproc: int, timeout: float,
               rejoin_s: Optional[float], progress: Optional[Callable[[RunRecord], None]], tag: str,
               auto_steps: bool, site: Optional[str]) -> RunRecord:
    out_dir.mkdir(parents=True, exist_ok=True)
    fault_log = out_dir / f"{tag}-faults.jsonl"
    fresh_log(fault_log)
    run_dir = out_dir / f"{tag}-run"
    command = [a.replace("{run_dir}", str(run_dir)) for a in command]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if plan is not None:
        env.update(fault_env(plan, out_dir, tag, fault_log, auto_steps=auto_steps, site=site))
    shm_before, ports_before = _shm(), _listening()
    rec = RunRecord(argv=[], started=time.monotonic(), nodes=nodes, backend=backend)

    def on_line(line: str) -> None:
        m = STEP_LINE.search(line)
        if m:
            rec.steps.append((time.monotonic(), int(m.group(1))))

    cluster = Cluster(nodes, backend, launcher_flags, command, out_dir, env, tag=tag, on_line=on_line)
    outside = list(plan.time_faults()) if plan is not None else []
    later: list[tuple[float, str, int]] = []  # (when, "resume" | "rejoin", node)
    due: list[tuple[int, Any]] = []  # time faults due, not yet fired
    deadline = rec.started + timeout
    try:
        cluster.start()
        rec.argv = cluster.argv(0, out_dir / "EVENTS")
        rec.store_endpoint = cluster.endpoint
        while cluster.running():
            now = time.monotonic()
            if now > deadline or stop_requested():
                rec.stopped = "timeout" if not stop_requested() else signal.Signals(stopped_by() or 15).name
                cluster.terminate()
                break
            _refresh(rec, cluster, fault_log, nproc)
            if rec.clock is None:
                rec.clock = full_size_at(rec.events, nodes * nproc, nodes)
                exited = [n for n in range(nodes) if (c := cluster.current(n)) is None or c.proc.poll() is not None]
                up = agents_up_at(rec.events, nodes, exited)
                if rec.clock is None and up is not None and now - max(up, rec.started) > FULL_SIZE_WAIT:
                    rec.clock = now
            while outside and rec.clock is not None and now - rec.clock >= float(outside[0][1].at_s or 0):
                due.append(outside.pop(0))
            for pending in list(due):
                index, fault = pending
                inj = _inject(index, fault, rec, cluster, nproc, later, rejoin_s)
                if inj is not None:
                    rec.injections.append(inj)
                    rec.unfired.pop(index, None)
                    due.remove(pending)
                    continue
                rec.unfired[index] = (f"{fault.target} was not running at "
                                      f"{now - (rec.clock or now):.1f}s after the planned times' start")
                # A worker target between rounds is hit once it runs again (within the grace);
                # an agent or a store is there or not: no second try.
                if fault.kind in ("kill-agent", "store-outage") or late(rec, fault, now):
                    due.remove(pending)
            for item in [x for x in later if x[0] <= now]:
                later.remove(item)
                if item[1] == "resume":
                    cluster.resume_store()
                elif not rec.finished_somewhere:  # a node rejoins a job still running only
                    cluster.spawn(item[2])
                    rec.rejoins.append((now, item[2]))
            if progress is not None:
                progress(rec)
            if stop_requested():
                continue
            time.sleep(0.05)
    finally:
        cluster.close()
    rec.ended = time.monotonic()
    rec.exit_code = cluster.exit_code()
    rec.stdout, rec.stderr = cluster.stdout(), cluster.stderr()
    rec.store_retries = list(cluster.retries)
    _refresh(rec, cluster, fault_log, nproc)
    rec.agents = [{"node": x.node, "agent": x.number, "pid": x.pid, "exit": x.proc.returncode,
                   "killed": x.killed} for x in cluster.incarnations]
    record_leaks(rec, shm_before, ports_before)
    if progress is not None:
        progress(rec)
    return rec


def _refresh(rec: RunRecord, cluster: Cluster, fault_log: Path, nproc: int) -> None:
    per = [(x.node, read_events(x.events)) for x in cluster.incarnations if x.events.exists()]
    rec.events = tag_events(per)
    rec.pids |= cluster.pids()
    for e in rec.events:
        if e.kind == "workers_started":
            rec.pids.update(int(p) for p in (e.fields.get("pids") or {}).values())
        elif e.kind in ("job_finished", "job_finished_elsewhere"):
            rec.finished_somewhere = True
    rec.injections = sorted([i for i in rec.injections if i.how == "outside"] + read_fault_log(fault_log),
                            key=lambda i: i.mono)
    read_worker_records(rec, fault_log)
    rec.ranks_seen.update(workers_by_rank(rec.events, max(1, nproc)))


def _inject(index: int, fault: Any, rec: RunRecord, cluster: Cluster, nproc: int,
            later: list[tuple[float, str, int]], rejoin_s: Optional[float]) -> Optional[Injection]:
    """Carry out one time fault; the injection, or None when its target is not running."""
    now = time.monotonic()
    target = str(fault.target)
    if fault.kind == "kill-agent":
        pid = cluster.kill_agent(int(fault.target.index))
        if pid is None:
            return None
        if rejoin_s is not None:
            later.append((now + rejoin_s, "rejoin", int(fault.target.index)))
        return Injection(index, fault.spec, target, now, pid, how="outside")
    if fault.kind == "store-outage":
        pid = cluster.pause_store()
        if pid is None:
            return None
        later.append((now + float(fault.param), "resume", -1))
        return Injection(index, fault.spec, target, now, pid, how="outside")
    sig = OUTSIDE_SIGNALS.get(fault.kind)
    workers = workers_by_rank(rec.events, nproc)
    if fault.target.kind == "rank":
        hit = [workers[fault.target.index][1]] if fault.target.index in workers else []
    else:
        hit = [pid for node, pid in workers.values() if node == fault.target.index]
    ours: set[int] = set()
    for x in cluster.incarnations:
        if x.proc.poll() is None:
            ours |= _descendants(x.pid)
    hit = [p for p in hit if p in ours]
    if sig is None or not hit:
        return None
    for pid in hit:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return Injection(index, fault.spec, target, now, hit[0], how="outside")

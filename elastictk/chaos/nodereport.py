"""The report's multi-node part: what a lost node and a store outage did to the job, read from
the event logs of every agent (each event tagged with its node), and the invariants for them.

A ``kill-agent`` is *detected* when a surviving node first reacts after it: a
``membership_changed`` (its heartbeat watch saw the node go) or a failure event (a survivor's
worker broke in a collective with the lost ranks first). The first is a membership change and
spends no restart; the second is a failure and spends one. The job is *running again* at the
next ``workers_started`` after that. A ``store-outage`` is *ridden through* when no node reacts
within the outage plus the heartbeat timeout; the survivors noticing a node killed before the
outage (a ``membership_changed`` naming it, due a heartbeat timeout after the kill) is the
kill's reaction, not the outage's.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from .expect import Expectation, Shape, long_outage
from .record import Injection, RunRecord

FAILURES = ("worker_failed", "peer_failed", "timer_expired")
REACTIONS = FAILURES + ("membership_changed", "store_lost", "rendezvous_failed")
BETWEEN_ROUNDS = "between rounds"  # a kill-agent outcome: the node ran no workers then


def _after(rec: RunRecord, kinds: Sequence[str], t: float, until: float = float("inf"),
           not_node: Optional[int] = None) -> Any:
    return next((e for e in rec.events if e.kind in kinds and t <= e.mono <= until
                 and (not_node is None or e.fields.get("node") != not_node)), None)


def _restart_count_before(rec: RunRecord, t: float) -> int:
    found = [int(e.fields.get("restart_count", 0)) for e in rec.events
             if e.kind == "workers_started" and e.mono <= t]
    return max(found, default=0)


def _members_at(rec: RunRecord, t: float) -> list[int]:
    """The nodes whose workers were running at ``t`` (started, not stopped since, and the
    node's agent not killed since: a SIGKILLed agent logs no ``workers_stopped``)."""
    running: dict[int, bool] = {}
    kills = sorted((i.mono, int(i.target.split(":")[1])) for i in rec.injections
                   if i.kind == "kill-agent" and i.mono < t)
    for e in rec.events:
        if e.mono > t:
            break
        while kills and kills[0][0] <= e.mono:
            running[kills.pop(0)[1]] = False
        if e.kind == "workers_started":
            running[e.fields.get("node")] = True
        elif e.kind in ("workers_stopped", "job_finished", "job_failed"):
            running[e.fields.get("node")] = False
    for _, node in kills:
        running[node] = False
    return sorted(n for n, up in running.items() if up)


def _killed_before_noticing(rec: RunRecord, index: int, at: float, by: float) -> set[int]:
    """Nodes whose own agent another ``kill-agent`` took between fault ``index`` (at ``at``) and
    ``by``, the latest a survivor had to notice it (the first reaction plus the heartbeat
    timeout): such a node is the next fault's victim, not a survivor that never noticed."""
    return {int(i.target.split(":")[1]) for i in rec.injections
            if i.kind == "kill-agent" and i.fault != index and at <= i.mono <= by}


def _joined(e: Any) -> bool:
    """A round re-formed because a node arrived (a rejoin): no reaction to a store outage."""
    return e.kind == "membership_changed" and e.fields.get("cause") == "node_joined"


def _killed_ids(rec: RunRecord, before: float) -> set[str]:
    """The node ids of agents a ``kill-agent`` took before ``before`` (each as it was when it
    was killed: a node that rejoins later comes back under a new id)."""
    out: set[str] = set()
    for i in rec.injections:
        if i.kind == "kill-agent" and i.mono < before:
            node = int(i.target.split(":")[1])
            ids = [e.node_id for e in rec.events if e.fields.get("node") == node and e.mono <= i.mono and e.node_id]
            out.update(ids[-1:])
    return out


def _loss_of(e: Any, killed: set[str]) -> bool:
    """A survivor's membership change that names a node an earlier ``kill-agent`` took: that
    fault's reaction, however late it comes (a heartbeat timeout after the kill)."""
    reason = str(e.fields.get("reason", ""))
    return (e.kind == "membership_changed" and e.fields.get("cause") == "lost_node"
            and any(reason.startswith(f"node {k} ") for k in killed))


def node_fault(fault: Any, inj: Injection, rec: RunRecord, shape: Shape) -> dict[str, Any]:
    """The row fields of a fired ``kill-agent`` or ``store-outage`` (see the module)."""
    at = inj.mono
    row: dict[str, Any] = {"injected_at": at - rec.started, "needs_restart": False}
    if fault.kind == "kill-agent":
        node = int(fault.target.index)
        seen = _after(rec, REACTIONS, at, not_node=node)
        if shape.backend == "c10d" and node == 0:
            row["outcome"] = "store host lost"
        elif node not in _members_at(rec, at):
            # Killed between rounds (its workers already stopped): no running round had it,
            # so nothing is there to notice; the next round forms without it (the finish check).
            row["outcome"], seen = BETWEEN_ROUNDS, None
        elif seen is None:
            row["outcome"] = "not seen"
        elif seen.kind == "membership_changed":
            row["outcome"] = "membership change"
        elif seen.kind in FAILURES:
            row["outcome"], row["needs_restart"] = "restart", True
        else:
            row["outcome"] = seen.kind.replace("_", " ")
    else:
        # Reactions after another fault hit (within the window) are that fault's doing, and so
        # is the survivors' notice of a node killed before the outage began.
        until = min([at + float(fault.param) + shape.heartbeat_timeout] +
                    [i.mono for i in rec.injections if i.fault != inj.fault and i.mono > at])
        killed = _killed_ids(rec, at)
        seen = next((e for e in rec.events if e.kind in REACTIONS + ("restart",) and at <= e.mono <= until
                     and not _joined(e) and not _loss_of(e, killed)), None)
        if seen is None:
            row["outcome"] = "ridden through"
        else:
            row["outcome"] = "restart" if _after(rec, ("restart",), at, seen.mono + 30) else (
                "membership change" if seen.kind == "membership_changed" else seen.kind.replace("_", " "))
    if seen is not None:
        row["detected_after"] = seen.mono - at
        back = _after(rec, ("workers_started",), seen.mono)
        if back is not None:
            row["running_after"] = back.mono - at
        restarted = _after(rec, ("restart",), at, seen.mono + 30)
        if restarted is not None:
            row["restarts_used"] = int(restarted.fields.get("restart_count", 0))
    return row


def checks(rows: Sequence[Any], rec: RunRecord, shape: Shape, exp: Expectation, nproc: int,
           restarts: int, needed: int) -> list[tuple[str, bool, str]]:
    """(name, ok, detail) of the multi-node invariants."""
    out: list[tuple[str, bool, str]] = []
    finished = rec.exit_code == 0
    out.append(("finishes iff the budget and the nodes left allow it",
                exp.finish is None or finished == exp.finish,
                f"{exp.why}: the job {'finished' if finished else f'failed (exit {rec.exit_code})'}, "
                f"expected it to {'finish or fail' if exp.finish is None else 'finish' if exp.finish else 'fail'}"))
    if not finished and exp.names is not None:
        ok = exp.names.lower() in rec.stderr.lower()
        out.append((f"fails naming {'the spent budget' if exp.names != 'store' else 'the lost store'}", ok,
                    f"stderr names {exp.names!r}" if ok else f"no {exp.names!r} in any agent's stderr"))
    longs = sum(1 for r in rows if r.fired and r.kind.startswith("store-outage")
                and long_outage(float(r.kind.split(":", 1)[1]), shape))
    if exp.finish:
        ok, want = needed <= restarts <= needed + longs, f"{needed}" + (f" to {needed + longs}" if longs else "")
    elif exp.names == "restart budget spent":
        ok, want = restarts == shape.max_restarts, str(shape.max_restarts)
    else:
        ok, want = restarts <= max(needed, shape.max_restarts), f"at most {max(needed, shape.max_restarts)}"
    out.append(("restarts counted == failures that needed one", ok, f"{restarts} restart(s) for {want} expected"))
    kills = [r for r in rows if r.fired and r.kind == "kill-agent"
             and r.outcome not in ("store host lost", BETWEEN_ROUNDS)]
    if kills:
        bad = []
        for r in kills:
            at = rec.started + (r.injected_at or 0)
            if r.detected_after is None:
                bad.append(f"#{r.index} never seen by a survivor")
                continue
            # Every member must notice: by reacting, by leaving its exit barrier without the
            # lost node, or by finishing before anyone reacted.
            first = at + r.detected_after
            gone = _killed_before_noticing(rec, r.index, at, first + shape.heartbeat_timeout)
            deaf = [n for n in _members_at(rec, at) if n != int(r.target.split(":")[1]) and n not in gone
                    and not any(e.fields.get("node") == n and e.mono >= at and (
                        e.kind in REACTIONS or e.kind == "exit_barrier_left"
                        or (e.kind == "job_finished" and e.mono <= first))
                        for e in rec.events)]
            if deaf:
                bad.append(f"#{r.index}: node(s) {', '.join(map(str, deaf))} never noticed the loss "
                           "(no membership change, failure or finish after it)")
            before = _restart_count_before(rec, at)
            back = _after(rec, ("workers_started",), at + r.detected_after)
            if r.outcome == "membership change" and back is not None and \
                    int(back.fields.get("restart_count", 0)) != before:
                bad.append(f"#{r.index} was a membership change but spent a restart")
            world = max((int(e.fields.get("world_size", 0)) for e in rec.events
                         if e.kind == "workers_started" and e.mono <= at), default=0)
            if back is not None and not shape.rejoin and int(back.fields.get("world_size", 0)) >= world:
                bad.append(f"#{r.index}: the job re-formed at world {back.fields.get('world_size')}, "
                           f"not below {world}")
        paths = ", ".join(f"#{r.index} {r.outcome}" for r in kills)
        out.append(("each lost node is seen by every survivor, and they re-form without it", not bad,
                    "; ".join(bad) or paths))
    outages = [r for r in rows if r.fired and r.kind.startswith("store-outage")]
    short = [r for r in outages if not long_outage(float(r.kind.split(":", 1)[1]), shape)]
    if short:
        bad = [f"#{r.index} {r.kind}: {r.outcome}" for r in short if r.outcome != "ridden through"]
        out.append((f"a store outage < heartbeat timeout {shape.heartbeat_timeout:g}s is ridden through",
                    not bad, "; ".join(bad) or f"{len(short)} ridden through, no restart, no re-formed round"))
    longer = [r for r in outages if r not in short]
    if longer:
        ok = finished or "store" in rec.stderr.lower() or any(r.outcome != "ridden through" for r in longer)
        out.append(("a longer store outage ends in a restart, a re-formed round or a failure naming the store",
                    ok, ", ".join(f"#{r.index} {r.outcome}" for r in longer)))
    return out

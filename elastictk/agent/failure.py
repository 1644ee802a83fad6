"""The failure path: from a round's failure outcome to the job's decision, and what follows it.

Apart from the loop because it is the one place a reader looks for "what does a node do when
something failed": each kind of failure (a worker of this node, a peer's, a failed health
check, an exclusion, an in-place recovery that did not come together) is reported first, the
workers stopped, and then the decision is made here (this node failed first) or awaited (a
peer did); on a restart the agent backs off and goes on to the next round, on a give-up the
job is shut down with the agent's result (:func:`on_failure`). What a failure is called comes
from ``failure_cause``; what the nodes agree on, from ``coordination``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from ..metrics.kinds import Emit, EventKind
from ..rendezvous import RendezvousHandler, RoundInfo
from ..supervisor.group import WorkerGroup
from ..supervisor.report import FailureReport
from ..supervisor.spec import WorkerResult
from .config import AgentConfig
from .coordination import Decision, RoundCoordinator
from .excluded import ExclusionGate
from .failure_cause import failed_at, first_failed, root_cause, why_failed
from .health import HealthWatch
from .inplace import InPlaceRound
from .outcome import AgentResult, DecisionAction, Outcome, ResultState
from .recovery import RecoveryWatch
from .watchdog import Watchdog

log = logging.getLogger("elastictk.agent")


@dataclass
class Scene:
    """What the failure path acts on: this node, its workers, its watches, its recorders."""

    node_id: str | None
    config: AgentConfig
    group: WorkerGroup
    emit: Emit
    recovery: RecoveryWatch
    watchdog: Watchdog | None
    health: HealthWatch | None
    exclusion: ExclusionGate
    inplace: InPlaceRound | None
    emit_expiries: Callable[[], None]  # the reaper's and the progress watch's news, as events
    stepped: Callable[[], bool | None]  # whether the attempt made a step (None: not counted)
    report: Callable[[int], FailureReport]  # the failure report at a restart count


def on_failure(s: Scene, handler: RendezvousHandler, info: RoundInfo, outcome: Outcome, failed: list[WorkerResult],
               coord: RoundCoordinator, restarts: int, noticed: float | None, attempt_pids: set[int],
               backoff: Callable[[float], None], attempts: int) -> AgentResult | None:
    """The whole failure path of a round that ended in ``outcome``: the recovery's first
    moment marked, the decision (:func:`after_failure`, or charged here when none came), and
    what the agent does with it: None after the restart's backoff (on to the next round), or
    the agent's result when the job gives up."""
    local = outcome == Outcome.LOCAL_FAILURE and noticed is not None
    s.recovery.failed(failed_at(failed, s.watchdog) if local else None,
                      noticed if local and noticed is not None else time.monotonic(), attempt_pids)
    decision = after_failure(s, outcome, failed, coord, restarts)
    if decision is None:
        # No decision came (the node that failed first died before deciding, or never
        # could): the failure is charged, not forgiven, as an OTP supervisor escalates.
        note = coord.failure_note()
        cause = f"round {info.round}: no decision came for " + (
            "a failure" if note is None else f"node {note.node_id}'s failure ({note.headline})")
        decision = coord.take_over(s.config.policy, cause, s.config.decision_timeout)
        log.warning("%s: charged by %s", cause, "this node or the one that took over")
    if decision.action == DecisionAction.RESTART:
        s.recovery.restarting(decision.restart_count)
        s.emit(EventKind.RESTART, restart_count=decision.restart_count, delay_s=decision.delay_s,
               reason=decision.reason)
        backoff(decision.delay_s)
        return None
    handler.shutdown(f"failed: {decision.reason}")
    report = s.report(restarts) if outcome == Outcome.LOCAL_FAILURE else None
    s.emit(EventKind.JOB_FAILED, reason=decision.reason)
    note = coord.failure_note()
    where = "" if note is None or note.node_id == handler.node_id else \
        f" (first failure on node {note.node_id}: {note.headline})"
    return AgentResult(ResultState.FAILED, 1, decision.reason + where, report=report,
                       restarts=restarts, attempts=attempts)


def after_failure(s: Scene, outcome: Outcome, failed: list[WorkerResult], coord: RoundCoordinator,
                  restarts: int) -> Decision | None:
    """Report this node's failure (or learn a peer's), stop the workers, and return the job's
    decision: made here when this node's report was first, else the one published; None when
    none came within the decision timeout (the caller charges it then)."""
    if outcome == Outcome.UNHEALTHY:
        return _unhealthy(s, coord)
    if outcome == Outcome.EXCLUDED:  # the leader excluded this node: it leaves, as a failure
        decision = s.exclusion.leave_round(coord, s.group, s.config.policy, s.config.decision_timeout)
        s.recovery.stopped()
        return decision
    if outcome == Outcome.INPLACE_FALLBACK:
        # In-place recovery did not come together: restart everything, as restart-all
        # would have, on the budget already charged for this failure.
        assert s.inplace is not None
        coord.report_failure(f"node {s.node_id}: in-place recovery failed")
        _stop(s, "inplace_fallback")
        charged = s.inplace.decision
        if charged is not None:  # this node charged the recovery: its decision, sealed
            return coord.publish(charged, s.config.decision_timeout)
        # Errors but nothing failed here: the node whose worker failed charged it and
        # publishes; only if nobody does is the failure charged now (take_over).
        return coord.await_decision(min(s.config.decision_timeout, 5.0))
    if outcome == Outcome.LOCAL_FAILURE:
        first = first_failed(failed)
        s.emit_expiries()  # the reaper records an expiry before it kills
        progressed = s.stepped()
        why, extra = why_failed(first, s.watchdog)
        won = coord.report_failure(f"node {s.node_id}: {why}")
        s.emit(EventKind.WORKER_FAILED, rank=first.rank, local_rank=first.local_rank,
               exit=first.signal_name or f"code {first.exitcode}", first_in_job=won,
               **extra, **({} if progressed is None else {"phase": "training" if progressed else "startup"}))
        _stop(s, "worker_failed")
        if won:
            return coord.decide(s.config.policy, root_cause(s.report(restarts), first, progressed), progressed)
    else:
        note = coord.failure_note()
        s.emit(EventKind.PEER_FAILED, by=None if note is None else note.node_id)
        _stop(s, "peer_failed")
        inplace = s.inplace
        if inplace is not None and inplace.pending is not None and inplace.decision is not None:
            # A recovery this node charged was still forming: its charge is the decision.
            return coord.publish(inplace.decision, s.config.decision_timeout)
    return coord.await_decision(s.config.decision_timeout)


def _unhealthy(s: Scene, coord: RoundCoordinator) -> Decision | None:
    """Like a worker failure, charged to the budget: the job restarts without this node
    (the health gate keeps it out of the next round while the check fails)."""
    assert s.health is not None and s.health.failed is not None
    res, cmd = s.health.failed, s.config.health_check
    s.emit(EventKind.HEALTH_CHECK_FAILED, command=cmd, exit=res.exit, line=res.line)
    log.warning("health check failed (%s): %s; this node leaves the job", res.exit, res.line or "(no output)")
    cause = f"node {s.node_id}'s health check ({res.exit}: {res.line or 'no output'})"
    won = coord.report_failure(cause)
    _stop(s, "health_check_failed")
    if won:
        return coord.decide(s.config.policy, cause)
    return coord.await_decision(s.config.decision_timeout)


def _stop(s: Scene, reason: str) -> None:
    """Stop this node's workers after the failure was reported (never before: the first
    report names the node that failed first)."""
    s.group.stop()
    s.emit(EventKind.WORKERS_STOPPED, reason=reason)
    s.recovery.stopped()

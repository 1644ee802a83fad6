"""``EventKind``: every kind of event the agent reports, in one place.

The agent's emitters (``ElasticAgent._emit``, ``InPlaceRound.emit``) take an :class:`EventKind`,
so a misspelt kind is a type error, not a silent new label; the sinks (the event log,
:class:`~elastictk.metrics.agent_metrics.AgentMetrics`) key on it. Members are ``str``-valued:
the JSON event log, Prometheus labels and string comparisons (``e.kind == "restart"`` in
``elastictk.chaos``) see the plain value (``str(EventKind.RESTART) == "restart"``).
"""
from __future__ import annotations

import enum
from typing import Any, Protocol


class EventKind(str, enum.Enum):
    """One kind of agent event; the value is what the event log and metrics labels carry."""

    # rendezvous and membership
    RENDEZVOUS_STARTED = "rendezvous_started"  # the agent asks for the next rendezvous round
    ROUND_JOINED = "round_joined"  # it joined a round: its group rank and the number of nodes
    RENDEZVOUS_FAILED = "rendezvous_failed"  # rendezvous refused or broken (token, state): the agent fails
    MEMBERSHIP_CHANGED = "membership_changed"  # a node joined or was lost: the round is over
    HEALTH_CHECK_FAILED = "health_check_failed"  # --health-check exited non-zero: this node stays out
    SPARE_WAITING = "spare_waiting"  # the round is full (--nnodes MAX): this node waits as a spare
    NODE_EXCLUDED = "node_excluded"  # this node is out of the job for a cooldown (agent/excluded.py)
    # the node's workers
    WORKERS_STARTED = "workers_started"  # this node's workers started (an attempt began)
    WORKERS_KEPT = "workers_kept"  # in-place: the running workers carry on into the new round
    WORKERS_STOPPED = "workers_stopped"  # this node's workers were stopped, with the reason
    WORKER_FAILED = "worker_failed"  # a local worker failed (exit code, signal or timer)
    TIMER_EXPIRED = "timer_expired"  # a worker's watchdog timer expired; the worker is killed
    HANG_DETECTED = "hang_detected"  # a hung rank (learned or fixed deadline): stacks dumped, culprit killed
    HANG_DEADLINE = "hang_deadline"  # the learned hang deadlines changed (field deadlines: kind -> s)
    PROGRESS_STALLED = "progress_stalled"  # every rank past its learned deadline together: reported, not killed
    STRAGGLER = "straggler"  # the leader names a rank the others waited for (agent/stragglers.py)
    WORKER_FROZEN = "worker_frozen"  # in-place: a stopped (SIGSTOP'd) worker is killed to recover
    # failures and recovery
    PEER_FAILED = "peer_failed"  # a worker on another node failed first: restart with the job
    RESTART = "restart"  # the job restarts its workers (restart-all), charged to the budget
    INPLACE_RECOVERY = "inplace_recovery"  # in-place: failed workers replaced, a generation published
    INPLACE_RECOVERED = "inplace_recovered"  # in-place: the workers re-formed in the new generation
    INPLACE_RESIZED = "inplace_resized"  # in-place: kept workers re-formed with the new set of nodes
    INPLACE_FALLBACK = "inplace_fallback"  # in-place recovery failed: restart-all takes over
    RECOVERY = "recovery"  # a recovery's phases (detect ... first step), in ms, once its first step is done
    # the end
    EXIT_BARRIER_LEFT = "exit_barrier_left"  # finished, but left the exit barrier: a peer is lost
    JOB_FINISHED = "job_finished"  # every worker of the job finished: the agent succeeded
    JOB_FINISHED_ELSEWHERE = "job_finished_elsewhere"  # the job ended before this agent joined; field succeeded
    JOB_FAILED = "job_failed"  # the job gave up (restart budget spent): the agent fails
    STORE_LOST = "store_lost"  # the rendezvous store is gone: the agent fails
    SIGNALLED = "signalled"  # the agent was told to stop (SIGTERM, SIGINT, SIGHUP)

    def __str__(self) -> str:
        return str(self.value)


class Emit(Protocol):
    """What the agent reports events through: ``emit(EventKind.X, field=value, ...)``."""

    def __call__(self, kind: EventKind, **fields: Any) -> None: ...

"""``AgentMetrics``: the agent's events turned into Prometheus metrics on one registry.

It is an ``on_event(kind, **fields)`` sink, like the event log, so the agent knows nothing
about Prometheus: every transition the agent reports updates counters, gauges and histograms
on a registry that belongs to this agent alone (never prometheus-client's global default, so
two agents in one process, or a test, never share series). Every :class:`EventKind` is either
handled or listed as deliberately ignored (``HANDLED``); kinds that are no member and extra
fields are counted in ``elastictk_events_total`` and otherwise ignored, never an error.

Worker progress (steps, step time, goodput) comes from a
:class:`~elastictk.metrics.steps.WorkerStepsBlock`, read when Prometheus scrapes.
The metric reference is in docs/metrics.md.
"""
from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from typing import Any, Callable, Iterable, Mapping, TypeGuard

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from .labels import (
    LOST_NODE, MEMBERSHIP_CAUSES, STORE_LOST, TIMER_EXPIRED, BoundedLabel,
    exit_detail, membership_cause, sanitize,
)
from .kinds import EventKind
from .layout import STEP_BUCKETS
from .recovery import valid_phases
from .steps import StepTotals, WorkerStepsBlock, goodput, totals

log = logging.getLogger("elastictk.metrics")

# ``run_id``, not ``job``: Prometheus sets ``job`` on every series it scrapes (the scrape job's
# name), so a ``job`` label of ours would be renamed ``exported_job`` or need honor_labels.
BASE = ("run_id", "node", "role")
# "preempted": stopped by --preempt-signal (the ``signalled`` event with ``preempted=True``): the
# scheduler will end the job and may requeue it, which is neither a success nor a failure.
STATES = ("rendezvous", "running", "recovering", "succeeded", "failed", "signalled", "preempted")
KNOWN_KINDS = tuple(k.value for k in EventKind)  # always their own ``kind`` label value
# Kinds that change no metric but elastictk_events_total: the in-place details (a recovery's
# failure and the restart that may follow are their own events), kept workers (still running),
# and leaving the exit barrier (job_finished follows).
IGNORED = frozenset({
    EventKind.WORKERS_KEPT, EventKind.WORKER_FROZEN, EventKind.INPLACE_RECOVERY, EventKind.INPLACE_RECOVERED,
    EventKind.HANG_DETECTED,  # the kill that follows is a worker_failed
    EventKind.INPLACE_RESIZED, EventKind.INPLACE_FALLBACK, EventKind.EXIT_BARRIER_LEFT,
    EventKind.HEALTH_CHECK_FAILED,  # counted in events_total{kind=}; the node is not in a round
    EventKind.SPARE_WAITING,  # counted in events_total{kind=}; a spare is not in a round
    EventKind.NODE_EXCLUDED,  # counted in events_total{kind=}; workers_stopped comes with it
})
# No ``<counter>_created`` series: one more series per counter and label set that no panel or
# rule of elastictk reads (process-wide in prometheus-client; elastictk exports no other way).
disable_created_metrics()

RENDEZVOUS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RECOVERY_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class AgentMetrics:
    """Metrics of one agent. Call it (or :meth:`on_event`) with every event the agent emits.

    ``max_restarts`` enables ``elastictk_restarts_remaining``; ``local_world_size`` lets the
    world size be estimated as nodes x local workers when an event does not carry it; ``steps``
    adds the worker progress and goodput metrics. ``clock`` (monotonic seconds) is for tests.
    """

    def __init__(self, registry: CollectorRegistry, *, job: str, node: str | None = None,
                 role: str = "default", max_restarts: int | None = None,
                 local_world_size: int | None = None, steps: WorkerStepsBlock | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.labels = (sanitize(job, 128), sanitize(node or socket.gethostname(), 128), sanitize(role, 64))
        self.max_restarts, self.local_world_size, self.steps = max_restarts, local_world_size, steps
        self._clock, self._wall = clock, wall_clock
        self._lock = threading.Lock()
        self._kind = BoundedLabel(16, KNOWN_KINDS)
        self._scope = BoundedLabel(16)
        self._detail = BoundedLabel(24)  # exit codes and signal names: a closed set, but a big one
        r, b = registry, list(BASE)
        self.failures = Counter("elastictk_worker_failures", "Worker failures on this node, by reason "
                                "(exit_code, signal, timer_expired, lost_node, other) and detail "
                                "(the code, signal name or timer scope).", b + ["reason", "detail"], registry=r)
        self.peer_failures = Counter("elastictk_peer_failures", "Restarts of this node's workers "
                                     "caused by a failure on another node.", b, registry=r)
        self.restarts = Counter("elastictk_restarts", "Restarts of the worker group that this "
                                "agent carried out.", b, registry=r)
        self.attempts = Counter("elastictk_worker_group_starts", "Times this agent started its "
                                "workers (first start, restarts and re-rendezvous).", b, registry=r)
        self.rounds = Counter("elastictk_rendezvous_rounds", "Rendezvous rounds this agent joined.",
                              b, registry=r)
        self.rdzv_duration = Histogram("elastictk_rendezvous_duration_seconds", "From needing a "
                                       "round (start, or the end of an attempt) to having joined one.",
                                       b, buckets=RENDEZVOUS_BUCKETS, registry=r)
        self.round = Gauge("elastictk_rendezvous_round", "Number of the round this agent is in.", b, registry=r)
        self.nodes = Gauge("elastictk_nodes", "Nodes in the current round.", b, registry=r)
        self.world_size = Gauge("elastictk_world_size", "Workers in the whole job (WORLD_SIZE).", b, registry=r)
        self.running = Gauge("elastictk_workers_running", "Workers of this node currently running.",
                             b, registry=r)
        self.recovery = Histogram("elastictk_recovery_duration_seconds", "From a failure being "
                                  "detected to the workers running again.", b,
                                  buckets=RECOVERY_BUCKETS, registry=r)
        self.phases = Histogram("elastictk_recovery_phase_seconds", "Each phase of a recovery, "
                                "from the recovery event: detect, stop, rendezvous, start, restore, "
                                "first_step (a phase that does not apply is not observed).",
                                b + ["phase"], buckets=PHASE_BUCKETS, registry=r)
        self.redone = Counter("elastictk_steps_redone", "Steps the job ran again after a restart: "
                              "those after the step it resumed from up to the last it had "
                              "completed before the failure (the most of any local rank).", b, registry=r)
        self.timer_expirations = Counter("elastictk_timer_expirations", "Watchdog timers that "
                                         "expired, by scope.", b + ["scope"], registry=r)
        self.membership = Counter("elastictk_membership_changes", "Membership changes that ended "
                                  "an attempt, by cause.", b + ["cause"], registry=r)
        self.scale = Counter("elastictk_scale_events", "Rounds with more (up) or fewer (down) "
                             "nodes than the round before.", b + ["direction"], registry=r)
        self.state = Gauge("elastictk_agent_state", "1 for the state the agent is in, 0 for the others.",
                           b + ["state"], registry=r)
        self.events = Counter("elastictk_events", "Events the agent reported, by kind.", b + ["kind"], registry=r)
        self.start_time = Gauge("elastictk_start_time_seconds", "Unix time the workers first started.",
                                b, registry=r)
        self.straggler = Gauge("elastictk_straggler_slowdown", "How many times slower than the "
                               "others' median the rank last flagged as a straggler on a node is "
                               "(its own time per step; set by the round's leader, reset when "
                               "workers start).", b + ["straggler_node"], registry=r)
        self._straggler_node = BoundedLabel(16)
        self.hang_deadline = Gauge("elastictk_hang_deadline_seconds", "Learned hang deadline by kind of "
                                   "progress (progress: any mark; step; section:NAME): how long a rank "
                                   "may go without it (--hang-detection learned, docs/timers.md).",
                                   b + ["kind"], registry=r)
        self._deadline_kind = BoundedLabel(16)
        self.stalls = Counter("elastictk_progress_stalls", "Times every rank of this node went past its "
                              "learned deadline together, outside any hang (reported, not killed).",
                              b, registry=r)
        self.remaining: Gauge | None = None
        if max_restarts is not None:
            Gauge("elastictk_max_restarts", "The restart budget (--max-restarts).", b,
                  registry=r).labels(*self.labels).set(max_restarts)
            self.remaining = Gauge("elastictk_restarts_remaining", "Restarts left before the job "
                                   "gives up (max_restarts - restarts so far).", b, registry=r)
            self.remaining.labels(*self.labels).set(max_restarts)
        # present from the start (at 0), so increase() and rate() see the first one
        for metric in (self.peer_failures, self.restarts, self.attempts, self.rounds, self.redone):
            metric.labels(*self.labels).inc(0)
        self._first_start: float | None = None
        self._ended: float | None = None
        self._failed_at: float | None = None
        self._rdzv_from: float | None = clock()
        self._attempt_open = False
        self._prev_nodes: int | None = None
        self._timer_scopes: dict[int, str] = {}
        self.current_state = "rendezvous"  # one of STATES: what elastictk_agent_state says now
        self._set_state("rendezvous")
        if steps is not None:
            registry.register(_StepsCollector(self, steps))
        K = EventKind
        handlers: dict[EventKind, Callable[[float, dict[str, Any]], None]] = {
            K.RENDEZVOUS_STARTED: self._rendezvous_started, K.ROUND_JOINED: self._round_joined,
            K.WORKERS_STARTED: self._workers_started, K.WORKERS_STOPPED: self._workers_stopped,
            K.WORKER_FAILED: self._worker_failed, K.PEER_FAILED: self._peer_failed,
            K.MEMBERSHIP_CHANGED: self._membership_changed, K.TIMER_EXPIRED: self._timer_expired,
            K.RESTART: self._restart, K.JOB_FAILED: self._job_failed,
            K.JOB_FINISHED: self._job_finished, K.JOB_FINISHED_ELSEWHERE: self._ended_elsewhere,
            K.SIGNALLED: self._signalled, K.STORE_LOST: self._job_failed,
            K.RENDEZVOUS_FAILED: self._job_failed, K.STRAGGLER: self._straggler,
            K.RECOVERY: self._recovered, K.HANG_DEADLINE: self._hang_deadline,
            K.PROGRESS_STALLED: lambda _now, _f: self.stalls.labels(*self.labels).inc(),
        }
        # Every kind, handled or (None) deliberately ignored: a new member must be placed here.
        self._handlers: Mapping[EventKind, Callable[[float, dict[str, Any]], None] | None] = {
            kind: None if kind in IGNORED else handlers[kind] for kind in EventKind}

    # -- the sink -------------------------------------------------------------------------------
    def __call__(self, kind: EventKind | str, **fields: Any) -> None:
        """Record one event; never raises (a metrics bug must not stop a training job).
        ``kind`` is an :class:`EventKind`; another string is counted, and otherwise ignored."""
        try:
            now = self._clock()
            with self._lock:
                self.events.labels(*self.labels, self._kind(kind)).inc()
                member = _member(kind)
                handler = None if member is None else self._handlers[member]
                if handler is not None:
                    handler(now, fields)
        except Exception:
            log.warning("metrics: could not record event %r %r", kind, fields, exc_info=True)

    on_event = __call__

    def elapsed(self) -> float | None:
        """Wall seconds (monotonic) from the first start of workers to now, or to the job's end."""
        with self._lock:
            if self._first_start is None:
                return None
            end = self._ended if self._ended is not None else self._clock()
            return max(0.0, end - self._first_start)

    # -- handlers (called with the lock held) ---------------------------------------------------
    def _rendezvous_started(self, now: float, f: dict[str, Any]) -> None:
        self._rdzv_from = now
        if self._failed_at is None:
            self._set_state("rendezvous")

    def _round_joined(self, now: float, f: dict[str, Any]) -> None:
        L = self.labels
        self.rounds.labels(*L).inc()
        if self._rdzv_from is not None:
            self.rdzv_duration.labels(*L).observe(max(0.0, now - self._rdzv_from))
            self._rdzv_from = None
        if _is_int(f.get("round")):
            self.round.labels(*L).set(f["round"])
        nodes = f.get("world")
        if _is_int(nodes):
            self.nodes.labels(*L).set(nodes)
            if self._prev_nodes is not None and nodes != self._prev_nodes:
                self.scale.labels(*L, "up" if nodes > self._prev_nodes else "down").inc()
            self._prev_nodes = nodes
        self._set_world(f)

    def _workers_started(self, now: float, f: dict[str, Any]) -> None:
        L = self.labels
        self.attempts.labels(*L).inc()
        pids = f.get("pids")
        count = len(pids) if isinstance(pids, (dict, list, tuple)) else self.local_world_size
        if count is not None:
            self.running.labels(*L).set(count)
        if self._first_start is None:
            self._first_start = now
            self.start_time.labels(*L).set(self._wall())
        if self._failed_at is not None:
            self.recovery.labels(*L).observe(max(0.0, now - self._failed_at))
            self._failed_at = None
        self._rdzv_from = None
        self._remaining(f.get("restart_count"))
        self._set_world(f)
        self._timer_scopes.clear()
        self.straggler.clear()
        self._attempt_open = True
        self._set_state("running")

    def _straggler(self, now: float, f: dict[str, Any]) -> None:
        slowdown = f.get("slowdown")
        if isinstance(slowdown, (int, float)):
            node = self._straggler_node(str(f.get("straggler_node", "unknown")))
            self.straggler.labels(*self.labels, node).set(float(slowdown))

    def _workers_stopped(self, now: float, f: dict[str, Any]) -> None:
        self.running.labels(*self.labels).set(0)

    def _worker_failed(self, now: float, f: dict[str, Any]) -> None:
        scope = f.get("timer_scope")
        if scope is None:
            for key in ("local_rank", "rank"):
                if _is_int(f.get(key)) and f[key] in self._timer_scopes:
                    scope = self._timer_scopes[f[key]]
                    break
        if scope is not None or f.get("cause") == TIMER_EXPIRED:
            reason, detail = TIMER_EXPIRED, self._scope(scope or "none")
        else:
            reason, detail = exit_detail(f.get("exit"))
            detail = self._detail(detail)
        self.failures.labels(*self.labels, reason, detail).inc()
        self._failure(now)
        self._end_attempt(now)

    def _peer_failed(self, now: float, f: dict[str, Any]) -> None:
        self.peer_failures.labels(*self.labels).inc()
        self._failure(now)
        self._end_attempt(now)

    def _membership_changed(self, now: float, f: dict[str, Any]) -> None:
        cause = f.get("cause")
        if cause not in MEMBERSHIP_CAUSES:
            cause = membership_cause(f.get("reason"))
        self.membership.labels(*self.labels, cause).inc()
        if cause == LOST_NODE:
            self.failures.labels(*self.labels, LOST_NODE, "").inc()
        if cause in (LOST_NODE, STORE_LOST):
            self._failure(now)
        else:
            self._set_state("rendezvous")
        self._end_attempt(now)

    def _timer_expired(self, now: float, f: dict[str, Any]) -> None:
        scope = self._scope(f.get("scope", "none"))
        self.timer_expirations.labels(*self.labels, scope).inc()
        for key in ("local_rank", "rank"):
            if _is_int(f.get(key)):
                self._timer_scopes[f[key]] = scope
        self._failure(now)

    def _hang_deadline(self, now: float, f: dict[str, Any]) -> None:
        deadlines = f.get("deadlines")
        if isinstance(deadlines, dict):
            for kind, seconds in deadlines.items():
                if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
                    self.hang_deadline.labels(*self.labels, self._deadline_kind(str(kind))).set(seconds)

    def _restart(self, now: float, f: dict[str, Any]) -> None:
        self.restarts.labels(*self.labels).inc()
        self._remaining(f.get("restart_count"))
        delay = f.get("delay_s")
        self._rdzv_from = now + (float(delay) if isinstance(delay, (int, float)) and delay > 0 else 0.0)
        self._set_state("recovering")

    def _recovered(self, now: float, f: dict[str, Any]) -> None:
        """A recovery's phases, each into its histogram; its redone steps into the counter."""
        for phase, ms in valid_phases(f.get("phases_ms")).items():
            self.phases.labels(*self.labels, phase).observe(ms / 1000)
        redone = f.get("steps_redone")
        if _is_int(redone) and redone > 0:
            self.redone.labels(*self.labels).inc(redone)

    def _job_failed(self, now: float, f: dict[str, Any]) -> None:
        self._end_attempt(now)
        self._finish(now, "failed")

    def _ended_elsewhere(self, now: float, f: dict[str, Any]) -> None:
        """The job ended before this node ran anything: its state is the job's outcome."""
        if f.get("succeeded", True):
            self._job_finished(now, f)
        else:
            self._job_failed(now, f)

    def _job_finished(self, now: float, f: dict[str, Any]) -> None:
        self.running.labels(*self.labels).set(0)
        self._attempt_open = False  # finished work is never lost
        self._finish(now, "succeeded")

    def _signalled(self, now: float, f: dict[str, Any]) -> None:
        self._end_attempt(now)
        self._finish(now, "preempted" if f.get("preempted") is True else "signalled")

    # -- helpers --------------------------------------------------------------------------------
    def _failure(self, now: float) -> None:
        if self._failed_at is None:
            self._failed_at = now
        self._set_state("recovering")

    def _end_attempt(self, now: float) -> None:
        """The running attempt is over (its workers are being stopped): progress not covered
        by a checkpoint is lost, and the agent heads back to rendezvous."""
        if self._attempt_open:
            self._attempt_open = False
            if self.steps is not None:
                self.steps.end_attempt()
        self.running.labels(*self.labels).set(0)
        self._rdzv_from = now

    def _finish(self, now: float, state: str) -> None:
        if self._ended is None:
            self._ended = now
        self._failed_at = self._rdzv_from = None
        self._set_state(state)

    def _remaining(self, restart_count: Any) -> None:
        if self.remaining is not None and self.max_restarts is not None and _is_int(restart_count):
            self.remaining.labels(*self.labels).set(max(0, self.max_restarts - restart_count))

    def _set_world(self, f: dict[str, Any]) -> None:
        size = f.get("world_size")
        if not _is_int(size) and self._prev_nodes is not None and self.local_world_size:
            size = self._prev_nodes * self.local_world_size
        if _is_int(size):
            self.world_size.labels(*self.labels).set(size)

    def _set_state(self, state: str) -> None:
        self.current_state = state
        for s in STATES:
            self.state.labels(*self.labels, s).set(1 if s == state else 0)


def _member(kind: EventKind | str) -> EventKind | None:
    try:
        return EventKind(kind)
    except (ValueError, TypeError):
        return None


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


class _StepsCollector:
    """Reads the steps block on every scrape; the workers never wait for it."""

    def __init__(self, metrics: AgentMetrics, block: WorkerStepsBlock) -> None:
        self._metrics, self._block = metrics, block
        self._lock = threading.Lock()
        self._lost = (0, 0.0)  # high-water mark: a counter never goes down

    def _totals(self, slots: list[Any]) -> StepTotals:
        """Totals whose loss never decreases (a worker that saves a checkpoint while being
        stopped would otherwise take back a loss already exported)."""
        t = totals(slots, self._block.epoch)
        with self._lock:
            self._lost = (max(self._lost[0], t.lost_steps), max(self._lost[1], t.lost_seconds))
            return dataclasses.replace(t, lost_steps=self._lost[0], lost_seconds=self._lost[1])

    def describe(self) -> Iterable[Metric]:
        return []  # names are not known to the registry's duplicate check; they are unique here

    def collect(self) -> Iterable[Metric]:
        slots = self._block.snapshot()
        if not slots:
            return []
        L = list(self._metrics.labels)
        t = self._totals(slots)
        names = list(BASE)
        steps = CounterMetricFamily("elastictk_steps", "Training steps the workers reported, by "
                                    "local rank (every process that ran in that rank).",
                                    labels=names + ["local_rank"])
        for s in slots:
            steps.add_metric(L + [str(s.local_rank)], s.steps)
        hist = HistogramMetricFamily("elastictk_step_duration_seconds", "Duration of the timed "
                                     "training steps of this node's workers.", labels=names)
        cumulative, buckets = 0, []
        for bound, n in zip(list(STEP_BUCKETS) + [float("inf")], t.buckets, strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        hist.add_metric(L, buckets, t.seconds)
        out: list[Metric] = [steps, hist]
        for name, doc, value in (
            ("elastictk_step_seconds", "Summed duration of the timed steps.", t.seconds),
            ("elastictk_lost_steps", "Steps lost to failures: done after the last checkpoint of a "
             "process whose attempt then failed or restarted.", t.lost_steps),
            ("elastictk_lost_step_seconds", "Step time lost to failures.", t.lost_seconds),
            ("elastictk_checkpoints", "Checkpoints the workers reported.", t.checkpoints),
        ):
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(L, value)
            out.append(family)
        if t.last_step_wall > 0:
            last = GaugeMetricFamily("elastictk_last_step_time_seconds", "Unix time of the latest "
                                     "step any local worker reported.", labels=names)
            last.add_metric(L, t.last_step_wall)
            out.append(last)
        elapsed = self._metrics.elapsed()
        ratio = None if elapsed is None else goodput(t, elapsed)
        if ratio is not None:
            g = GaugeMetricFamily("elastictk_goodput_ratio", "Share of wall time since the first "
                                  "start that reporting workers spent in steps not lost to a "
                                  "failure (see docs/metrics.md).", labels=names)
            g.add_metric(L, ratio)
            out.append(g)
        return out

"""The elastic agent: rendezvous, start workers, watch, and on any change restart as one job.

One agent runs per node. Its loop is the whole of torchrun's elastic behaviour, built from the
primitives: a :class:`RendezvousHandler` for membership, a :class:`WorkerGroup` for the local
processes, a :class:`RestartPolicy` for the budget, and a :class:`RoundCoordinator` for what
the nodes must agree on (who failed first, what the job does next, when everyone is done).
Everything the loop waits for wakes it as it happens: a worker's exit (pidfd), a peer's
failure (a store key), a membership change (the next round's arrival), a signal.
"""
from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..rendezvous import (
    MembershipWatch, RendezvousClosed, RendezvousError, RendezvousHandler,
    RendezvousInterrupted, RoundAbandoned, RoundInfo,
)
from ..store import Store, StoreError
from ..supervisor.env import Assignment
from ..supervisor.forkserver import PreloadServer
from ..supervisor.group import StartInterrupted, WorkerGroup
from ..supervisor.report import FailureReport
from ..supervisor.spec import WorkerResult
from ..metrics.kinds import Emit, EventKind
from ..metrics.steps import WorkerStepsBlock
from ..snapshot.local import Holder
from ..snapshot.peertier import PeerTier
from .address import local_address
from .assign import round_assignment
from .health import HealthWatch, hold_until_healthy
from .coordination import Budget, RoundCoordinator
from .ending import closed_elsewhere, exit_barrier, host_leaves_last, job_finished, signalled
from .excluded import ExclusionGate
from .inplace import InPlaceRound, begin_round
from .inplace_host import InPlaceHost, started_key
from .monitor import monitor
from .config import AgentConfig
from .outcome import AgentResult, Outcome, Recovery, ResultState
from .failure import Scene, on_failure
from .failure_cause import failure_report
from .recovery import RecoveryWatch
from .shared_flags import mismatch, rank0_meta
from .signals import Signals
from .stepcount import steps_block, stepped
from .stragglers import StragglerWatch, watch_round
from .watchdog import Watchdog
from .workerspec import join_meta, workers_spec

log = logging.getLogger("elastictk.agent")

Event = Emit  # what on_event is called as (the old name)


@dataclass
class _Round:
    """One rendezvous round as the loop sees it, from joining to what ended it."""

    info: RoundInfo
    restarts: int  # the job's restart count when the round began
    coord: RoundCoordinator
    watch: MembershipWatch
    outcome: Outcome = Outcome.SUCCEEDED
    failed: list[WorkerResult] = field(default_factory=list)
    cooperative: bool = False  # in-place workers that re-form: kept through a change of nodes
    noticed: float | None = None  # monotonic: when the monitor returned the outcome


class ElasticAgent:
    """Runs one node of a job until it succeeds, gives up, or is told to stop."""

    def __init__(self, config: AgentConfig, store: Store, *, store_endpoint: str | None = None,
                 preload_server: PreloadServer | None = None) -> None:
        self.config = config
        self._preload_server = preload_server  # the caller's, started early (it owns it)
        self.store = store
        self.node_id = config.node_id
        self._store_endpoint = store_endpoint
        # The signals that end the agent: the terminating ones and the pre-emption warning.
        preempt_signal = (config.preempt_signal,) if config.preempt_signal else ()
        self._signals = Signals(tuple(config.stop_signals) + preempt_signal, self._interrupt, self._wake)
        self.group: WorkerGroup | None = None
        self.handler: RendezvousHandler | None = None
        self.current: RoundInfo | None = None
        self._joined: RoundInfo | None = None  # the last round joined (its members read only if needed)
        self.watchdog: Watchdog | None = None
        self._lingering: list[MembershipWatch | RoundCoordinator] = []
        self.attempts = 0
        self._inplace_host: InPlaceHost | None = None
        self._inplace: InPlaceRound | None = None
        self._assignment_now: Assignment | None = None
        self._keep = False  # in-place: the workers run on through the next round
        self._ran = False
        self._budget: Budget | None = None  # the job-wide restart state, once admitted to the run
        self._steps: WorkerStepsBlock | None = None  # read for the crash-loop count
        self._attempt_pids: set[int] = set()  # the current attempt's workers, as started
        self._health: HealthWatch | None = None  # --health-check while a round runs
        self._recovery = RecoveryWatch(self._emit, None)  # given the steps block in run()
        self._replaced_at: float | None = None  # in place: when the failures being replaced exited
        self._peer: PeerTier | None = None  # the peer snapshot tier (run() opens it)
        self._exclusion = ExclusionGate(config.exclusion, self._emit, self._wake, config.rdzv.min_nodes)

    # -- public -----------------------------------------------------------------------------
    def run(self) -> AgentResult:
        cfg = self.config
        addr = cfg.local_addr or local_address(self._store_endpoint)
        # The local snapshot tier: memory that outlives the workers and dies with this agent.
        snapshots = Holder(cfg.spec.local_world_size, cfg.snapshot_memory) if cfg.snapshot_memory else None
        self._peer = (PeerTier(snapshots, addr, cfg.rdzv.token, cfg.rdzv.job_id, cfg.snapshot_replicas,
                               cfg.snapshot_replica_memory or snapshots.memory)
                      if snapshots is not None and cfg.snapshot_replicas else None)
        if self._peer is not None and cfg.metrics_registry is not None:  # the replicas' lag, per rank
            cfg.metrics_registry.register(self._peer.collector())
        self.handler = RendezvousHandler(self.store, cfg.rdzv, node_id=self.node_id,
                                         meta=join_meta(cfg, addr, self._peer))
        self.node_id = self.handler.node_id
        self.handler.on_spare = lambda n, world: self._emit(EventKind.SPARE_WAITING, round=n, world=world)
        self._steps, own_steps = steps_block(
            cfg.steps, cfg.policy.crash_loop is not None or bool(cfg.stragglers and cfg.stragglers.on),
            cfg.spec.local_world_size)
        self._recovery = RecoveryWatch(self._emit, self._steps)
        self.watchdog = Watchdog(cfg.spec.local_world_size, collective_timeout=cfg.collective_timeout,
                                 on_expiry=self._wake, progress_timeout=cfg.progress_timeout,
                                 startup_timeout=cfg.startup_timeout, steps=self._steps,
                                 hang_detection=cfg.hang_detection)
        spec = workers_spec(cfg, self.watchdog, self._steps, own_steps, snapshots, self._peer)
        self.group = WorkerGroup(spec, cfg.log_dir, preload_server=self._preload_server)
        self._signals.install()
        try:
            self.group.prepare()  # e.g. the preload server imports torch while we rendezvous
            # The loop first: host_leaves_last needs the round it joined, which the loop sets
            # (passed as one call's arguments, the round was read before the loop ran: None).
            result = self._loop(addr)
            return self._summarized(host_leaves_last(self.handler, cfg, self._joined, result))
        except StoreError as e:
            # The store is gone (e.g. the host of a c10d store died): fail fast, never hang.
            self.group.stop()
            self._emit(EventKind.STORE_LOST, error=str(e))
            return self._summarized(AgentResult(ResultState.FAILED, 1, str(e), attempts=self.attempts))
        except RendezvousError as e:
            # Refused (no token), forged or foreign state, too few nodes: one line, no traceback.
            self.group.stop()
            self._emit(EventKind.RENDEZVOUS_FAILED, error=str(e))
            return self._summarized(AgentResult(ResultState.FAILED, 1, str(e), attempts=self.attempts))
        finally:
            self._recovery.finish()  # an exception: the recovery in flight, before the block goes
            self._signals.restore()
            self.group.close()
            self.watchdog.close()
            if own_steps is not None:
                own_steps.close()
            if self._peer is not None:
                self._peer.close()
            if snapshots is not None:
                snapshots.close()
            # Watch threads were stopped without waiting (a failure must not wait for them);
            # they end within a wait interval. The process must not exit normally while one is
            # inside a c10d call (see AgentConfig.join_watchers).
            for w in self._lingering:
                w.stop(wait=self.config.join_watchers)
            if self._inplace_host is not None:
                self._inplace_host.close()
            try:
                self.handler.close(leaving=True)
            except StoreError:
                pass

    def _summarized(self, result: AgentResult) -> AgentResult:
        """``result`` with the end-of-job line on where recovery time went (a recovery still
        awaiting its first step is emitted first, with the phases known)."""
        self._recovery.finish()
        result.recovery_summary = self._recovery.summary()
        return result

    def pids(self) -> dict[int, int]:
        """Local rank → PID of the running workers (for fault injection and tests)."""
        return self.group.pids() if self.group else {}

    # -- the loop: one rendezvous round per turn, then one step per outcome -------------------
    def _loop(self, addr: str) -> AgentResult:
        steps: dict[Outcome, Callable[[_Round], AgentResult | None]] = {
            Outcome.SIGNAL: lambda _: self._signalled(), Outcome.MEMBERSHIP: self._on_membership,
            Outcome.SUCCEEDED: self._on_succeeded, Outcome.LOCAL_FAILURE: self._on_failure,
            Outcome.PEER_FAILURE: self._on_failure, Outcome.INPLACE_FALLBACK: self._on_failure,
            Outcome.UNHEALTHY: self._on_failure, Outcome.EXCLUDED: self._on_failure,
        }
        self._ran = False  # workers were started at least once
        while True:
            if self._signals.stop:
                return self._signalled()
            assert self.handler is not None and self.group is not None
            if self._exclusion.hold(self.handler, self.group, lambda: self._signals.stop_reason() is not None):
                self.node_id = self.handler.node_id  # out for the cooldown; rejoins under a new id
                continue
            kept_out = self._health_gate()
            if kept_out is not None:
                return kept_out
            info = self._next_round()
            if isinstance(info, AgentResult):
                return info
            try:
                rnd = self._run_round(info, addr)
            except RoundAbandoned as e:  # a member died before doing its part: next round
                self._emit(EventKind.MEMBERSHIP_CHANGED, reason=str(e), cause="lost_node")
                continue
            except RendezvousInterrupted:  # SIGTERM/SIGINT/SIGHUP while joining the round
                return self._signalled()
            result = steps[rnd.outcome](rnd)  # None: on to the next round
            if result is not None:
                return result
            self._exclusion.after_round(rnd.outcome, self.handler.node_id, rnd.noticed or time.monotonic(),
                                        rnd.coord.records, self._health.failed if self._health else None)

    def _health_gate(self) -> AgentResult | None:
        """``--health-check``: None once the check passes, else how the agent ends (the check
        did not pass within the join timeout, or a signal came while this node stayed out)."""
        cfg, group = self.config, self.group
        if cfg.health_check is None:
            return None
        assert group is not None

        def stop_kept() -> bool:  # in-place workers kept for the next round
            if not group.running:
                return False
            group.stop()
            return True
        why = hold_until_healthy(cfg.health_check, cfg.health_interval, cfg.rdzv.join_timeout,
                                 stop_workers=stop_kept, emit=self._emit, backoff=self._signals.backoff,
                                 stopping=lambda: self._signals.stop_reason() is not None)
        if why is None:
            return None
        return self._signalled() if why == "" else AgentResult(ResultState.FAILED, 1, why, attempts=self.attempts)

    def _next_round(self) -> RoundInfo | AgentResult:
        """The next round, or how the agent ends when the job was closed meanwhile."""
        assert self.handler is not None and self.group is not None
        self._emit(EventKind.RENDEZVOUS_STARTED, node_id=self.handler.node_id)
        try:
            info = self.handler.next_round()
            self._joined = info
            differs = None if info.rank == 0 else mismatch(self.handler.meta, rank0_meta(info))
            if differs is None:
                return info
            self.handler.shutdown(differs)  # the others end with the same line, not a hang
            return AgentResult(ResultState.FAILED, 2, differs, attempts=self.attempts)
        except RendezvousInterrupted:  # SIGTERM/SIGINT/SIGHUP while waiting for the others
            return self._signalled()
        except RendezvousClosed as e:
            return closed_elsewhere(e, self.group, self._ran, self.config.rdzv.job_id, self._emit, self.attempts)

    def _run_round(self, info: RoundInfo, addr: str) -> _Round:
        """Join ``info``: start (or keep) the workers and watch them until something happens."""
        assert self.handler is not None and self.group is not None
        handler, group = self.handler, self.group
        previous, self.current = self.current, info
        if self._budget is None:  # after the first round: the run's nonce is known
            self._budget = Budget(handler.records)
        restarts = self._budget.restart_count()
        self._assignment_now = round_assignment(self.config, handler, info, restarts, addr,
                                                lambda: self._signals.stop_reason() is not None)
        self._emit(EventKind.ROUND_JOINED, round=info.round, rank=info.rank, world=info.world_size)
        self._recovery.joined()
        coord = RoundCoordinator(handler.store, info.store, handler.node_id, on_failure=group.wake,
                                 signer=handler.signer, where=(handler.prefix, info.store_prefix),
                                 budget=self._budget, on_error=lambda _e: group.wake())
        rnd = _Round(info, restarts, coord, MembershipWatch(handler, info, on_change=group.wake))
        keep_asked, self._keep = self._keep, False
        cfg = self.config
        self._health = (HealthWatch(cfg.health_check, cfg.health_interval, group.wake)
                        if cfg.health_check is not None else None)
        stragglers: StragglerWatch | None = None
        try:
            try:
                self._start_workers(rnd, addr, keep_asked, previous)
                self._ran = True
                stragglers = watch_round(cfg.stragglers, self._steps, self._assignment_now.base_global_rank,
                                         coord.records, handler.node_id, info, self._emit, self._exclusion)
                rnd.outcome, rnd.failed = self._monitor(coord, rnd.watch)
                rnd.noticed = time.monotonic()
            except StartInterrupted:  # a terminating signal came while the workers started
                rnd.outcome = Outcome.SIGNAL
            rnd.cooperative = (rnd.outcome == Outcome.MEMBERSHIP and self._inplace is not None
                               and self._inplace.cooperative())
        finally:
            if self._health is not None:
                self._health.stop()
            if stragglers is not None:
                stragglers.stop()
            rnd.watch.stop()
            if self._inplace is not None:
                self._inplace.close()
        coord.stop()
        self._lingering += [rnd.watch, coord]
        return rnd

    def _start_workers(self, rnd: _Round, addr: str, keep: bool, previous: RoundInfo | None) -> None:
        """Start this node's workers for the round, or (in place) keep the running ones."""
        assert self.group is not None and self.handler is not None and self._assignment_now is not None
        group, assignment = self.group, self._assignment_now
        extra, kept = self._begin_inplace(rnd.info, addr, rnd.restarts, keep, previous)
        if kept:
            group.reassign(assignment, extra)
            assert self.watchdog is not None  # the kept workers' progress clocks start again
            self.watchdog.rearm_progress(group.pids(), assignment, group.attempt_dir)
            assert self._inplace is not None
            self._emit(EventKind.WORKERS_KEPT, generation=self._inplace.gen, pids=group.pids(),
                       world_size=assignment.global_world_size)
            self._peer_round(rnd.info, prefetch=False)
            return
        if group.running:  # kept, but the round starts afresh (its host is gone)
            group.stop()
            self._emit(EventKind.WORKERS_STOPPED, reason="inplace_host_lost")
        self._peer_round(rnd.info, prefetch=True)
        assert self.watchdog is not None
        self.watchdog.reset()  # before the start: a worker may claim its region at once
        group.start(self.attempts, assignment, extra)
        self._attempt_pids = set(group.pids().values())
        self.watchdog.arm(group.pids(), assignment, group.attempt_dir)
        self.attempts += 1
        self._emit(EventKind.WORKERS_STARTED, attempt=self.attempts - 1, restart_count=rnd.restarts,
                   pids=group.pids(), world_size=assignment.global_world_size, run_dir=str(group.run_log_dir))
        self._recovery.started(self._attempt_pids)
        if self._inplace is not None and self._inplace.pending is not None:  # joined in place
            rnd.coord.records.write(started_key(self.handler.node_id), {"node_id": self.handler.node_id})

    def _peer_round(self, info: RoundInfo, prefetch: bool) -> None:
        """The peer snapshot tier follows the round: its ring, its keys in the round's store, the
        replicas nobody can use any more, and (workers about to start) the parts to restore."""
        if self._peer is not None and self.handler is not None and self._assignment_now is not None:
            a = self._assignment_now
            self._peer.round(info.members, a.global_world_size, self.handler.node_id, a.base_global_rank, prefetch,
                             info.store)

    def _on_membership(self, rnd: _Round) -> None:
        assert self.group is not None
        watch, cause = rnd.watch, rnd.watch.cause
        self._emit(EventKind.MEMBERSHIP_CHANGED, reason=watch.reason, cause=cause)
        if (rnd.cooperative and cause in ("lost_node", "node_joined")
                and len(self.group.running) == self.config.spec.local_world_size):
            # In place: the workers run on (or wait, when a peer node is gone) while
            # the next round forms, then re-form with the new world.
            self._keep = True
            if self.watchdog is not None:  # waiting for the next round is not a hang
                self.watchdog.pause_progress()
            return
        self.group.stop()
        self._emit(EventKind.WORKERS_STOPPED, reason="membership_changed")
        if watch.store_error is not None:
            raise watch.store_error

    def _on_succeeded(self, rnd: _Round) -> AgentResult | None:
        assert self.handler is not None and self.group is not None
        finished, lost = exit_barrier(self.handler, rnd.coord, rnd.info, self.config.exit_barrier_timeout,
                                      self._signals.stop_reason, self._emit, self._lingering.append)
        if self._signals.stop:  # told to stop while waiting for the others
            return self._signalled()
        if not finished:
            rnd.outcome = Outcome.PEER_FAILURE  # a peer failed while we waited: restart with it
            return self._on_failure(rnd)
        return job_finished(self.handler, rnd.coord, rnd.info, self.config, self.group.results, self._emit,
                            len(lost), self.attempts)

    def _on_failure(self, rnd: _Round) -> AgentResult | None:
        assert self.handler is not None
        return on_failure(self._scene(), self.handler, rnd.info, rnd.outcome, rnd.failed, rnd.coord, rnd.restarts,
                          rnd.noticed, self._attempt_pids, self._signals.backoff, self.attempts)

    def _monitor(self, coord: RoundCoordinator, watch: MembershipWatch) -> tuple[Outcome, list[WorkerResult]]:
        assert self.group is not None
        return monitor(self.group, coord, watch, inplace=self._inplace, recovery=self._recovery,
                       watchdog=self.watchdog, signals=self._signals, health=self._health,
                       exclusion=self._exclusion, emit_expiries=self._emit_expiries,
                       assignment=self._assignment_now, on_replaced=self._replaced)

    def _replaced(self, at: float) -> None:
        self._replaced_at = at  # in place: when the failures being replaced exited

    def _scene(self) -> Scene:
        assert self.group is not None
        return Scene(self.node_id, self.config, self.group, self._emit, self._recovery, self.watchdog, self._health,
                     self._exclusion, self._inplace, self._emit_expiries, self._stepped, self._report)

    def _begin_inplace(self, info: RoundInfo, addr: str, restarts: int, keep: bool,
                       previous: RoundInfo | None) -> tuple[dict[str, str], bool]:
        """In-place mode: the round's generations and the workers' extra environment; True
        when this agent's running workers carry on into the round (``keep`` asked for it and
        the round's setup agreed)."""
        self._inplace = None
        if self.config.recovery != Recovery.IN_PLACE:
            return {}, False
        assert self.handler is not None and self.group is not None
        cfg, node_id = self.config, self.handler.node_id
        if self._inplace_host is None:
            self._inplace_host = InPlaceHost(addr, node_id)
        assert self._budget is not None
        self._inplace, env, kept = begin_round(self._inplace_host, self.group, self._budget, cfg, info, node_id,
                                               restarts=restarts, keep=keep, previous=previous,
                                               attempt=self.attempts, emit=self._inplace_emit)
        return env, kept

    def _report(self, restarts: int) -> FailureReport:
        assert self.group is not None
        return failure_report(list(self.group.results.values()), restarts, self.watchdog)

    def _signalled(self) -> AgentResult:
        assert self.group is not None and self.handler is not None
        return signalled(self.group, self._signals.received or signal.SIGTERM, self.config, self._emit,
                         self.attempts)

    # -- helpers ----------------------------------------------------------------------------
    def _stepped(self) -> bool | None:
        """Whether a worker of the current attempt completed a step (its slot is owned by it and
        counts a step of its own); None when no steps block is read."""
        if self.config.policy.crash_loop is None:
            return None
        return stepped(self._steps, self._attempt_pids)

    def _wake(self) -> None:
        if self.group is not None:
            self.group.wake()

    def _emit_expiries(self) -> None:
        """Events for timers the reaper caught since the last look (it runs on its own thread)."""
        if self.watchdog is not None:
            self.watchdog.emit_news(self._emit)

    def _inplace_emit(self, kind: EventKind, **fields: Any) -> None:
        """The in-place round's events, also timing its recoveries (replaced, then re-formed)."""
        self._emit(kind, **fields)
        self._recovery.inplace_event(kind, fields, self._replaced_at)

    def _emit(self, kind: EventKind, **fields: Any) -> None:
        log.info("%s %s", kind, " ".join(f"{k}={v}" for k, v in fields.items()))
        if self.config.on_event is not None:
            self.config.on_event(kind, **fields)

    def _interrupt(self) -> None:
        """A terminating signal: a node waiting for a round stops waiting; a start in progress
        stops before its next worker."""
        if self.handler is not None:
            self.handler.interrupt()
        if self.group is not None:
            self.group.interrupt()

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
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from ..rendezvous import (
    MembershipWatch, RendezvousClosed, RendezvousConfig, RendezvousError, RendezvousHandler, RoundInfo,
)
from ..store import Store, StoreError, free_port
from .address import is_ip, local_address
from .coordination import Decision, RoundCoordinator, restart_count
from .env import Assignment, NodeRanks, assign_ranks
from ..inplace.protocol import Generation, round_prefix
from .forkserver import PreloadServer
from .group import WorkerGroup
from .inplace import InPlaceRound
from .inplace_setup import InPlaceHost, started_key
from .policy import RestartPolicy
from .report import FailureReport
from .spec import WorkerResult, WorkerSpec
from .watchdog import Watchdog

log = logging.getLogger("elastictk.agent")

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
TERMINATING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

Event = Callable[..., None]


@dataclass
class AgentConfig:
    """Everything one node's agent needs; ``elastictk-run`` builds it from torchrun's flags."""

    spec: WorkerSpec
    rdzv: RendezvousConfig
    policy: RestartPolicy = field(default_factory=lambda: RestartPolicy(max_restarts=0))
    max_restarts: int = 0
    log_dir: str | Path | None = None
    node_id: str | None = None
    local_addr: str | None = None
    exit_barrier_timeout: float = 300.0
    hosts_store: bool = False
    decision_timeout: float = 30.0
    on_event: Event | None = None
    collective_timeout: float | None = None  # put every torch.distributed call under a timer
    recovery: str = "restart-all"  # or "in-place" (see supervisor/inplace.py)
    reform_timeout: float = 30.0  # in-place: longest wait for survivors to re-form
    # Whether run() returns only once its store-watching threads ended (each may sit up to a
    # heartbeat interval in a store wait). Needed where the process goes on or exits normally:
    # finalizing Python under a thread inside a c10d call aborts it. elastictk-run ends with
    # os._exit right after, so it does not wait (a job's exit is up to a second sooner).
    join_watchers: bool = True


@dataclass
class AgentResult:
    """How the agent ended; ``exit_code`` is what a launcher should exit with."""

    state: str  # succeeded | failed | finished-elsewhere | signalled
    exit_code: int
    message: str
    report: FailureReport | None = None
    return_values: dict[int, Any] = field(default_factory=dict)
    restarts: int = 0
    attempts: int = 0


class _Outcome:
    SUCCEEDED, LOCAL_FAILURE, PEER_FAILURE, MEMBERSHIP, SIGNAL, INPLACE_FALLBACK = range(6)


class ElasticAgent:
    """Runs one node of a job until it succeeds, gives up, or is told to stop."""

    def __init__(self, config: AgentConfig, store: Store, *, store_endpoint: str | None = None,
                 preload_server: PreloadServer | None = None) -> None:
        self.config = config
        self._preload_server = preload_server  # the caller's, started early (it owns it)
        self.store = store
        self.node_id = config.node_id
        self._store_endpoint = store_endpoint
        self._signal: int | None = None
        self._old_handlers: dict[int, Any] = {}
        self.group: WorkerGroup | None = None
        self.handler: RendezvousHandler | None = None
        self.current: RoundInfo | None = None
        self.watchdog: Watchdog | None = None
        self._lingering: list[MembershipWatch | RoundCoordinator] = []
        self.attempts = 0
        self._inplace_host: InPlaceHost | None = None
        self._inplace: InPlaceRound | None = None
        self._assignment_now: Assignment | None = None
        self._keep = False  # in-place: the workers run on through the next round

    # -- public -----------------------------------------------------------------------------
    def run(self) -> AgentResult:
        cfg = self.config
        addr = cfg.local_addr or local_address(self._store_endpoint)
        meta = {"addr": addr, "host": socket.gethostname(), "nproc": cfg.spec.local_world_size, "role": cfg.spec.role}
        self.handler = RendezvousHandler(self.store, cfg.rdzv, node_id=self.node_id, meta=meta)
        self.node_id = self.handler.node_id
        self.watchdog = Watchdog(cfg.spec.local_world_size, collective_timeout=cfg.collective_timeout,
                                 on_expiry=self._wake)
        spec = replace(cfg.spec, env=self.watchdog.worker_env(cfg.spec.env))
        self.group = WorkerGroup(spec, cfg.log_dir, preload_server=self._preload_server)
        self._install_signals()
        try:
            self.group.prepare()  # e.g. the preload server imports torch while we rendezvous
            return self._loop(addr)
        except StoreError as e:
            # The store is gone (e.g. the host of a c10d store died): fail fast, never hang.
            self.group.stop()
            self._emit("store_lost", error=str(e))
            return AgentResult("failed", 1, str(e), attempts=self.attempts)
        except RendezvousError as e:
            # Refused (no token), forged or foreign state, too few nodes: one line, no traceback.
            self.group.stop()
            self._emit("rendezvous_failed", error=str(e))
            return AgentResult("failed", 1, str(e), attempts=self.attempts)
        finally:
            self._restore_signals()
            self.group.close()
            self.watchdog.close()
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

    def pids(self) -> dict[int, int]:
        """Local rank → PID of the running workers (for fault injection and tests)."""
        return self.group.pids() if self.group else {}

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self, addr: str) -> AgentResult:
        assert self.handler is not None and self.group is not None
        cfg, handler, group = self.config, self.handler, self.group
        ran = False
        while True:
            if self._signal in TERMINATING:
                return self._signalled()
            self._emit("rendezvous_started", node_id=handler.node_id)
            try:
                info = handler.next_round()
            except RendezvousClosed as e:
                if group.running:
                    group.stop()  # kept for an in-place change that will not come
                if ran:
                    return AgentResult("failed", 1, str(e), attempts=self.attempts)
                self._emit("job_finished_elsewhere", message=str(e))
                return AgentResult("finished-elsewhere", 0, f"{e}; exiting", attempts=self.attempts)
            previous, self.current = self.current, info
            restarts = restart_count(handler.store, handler.signer, handler.prefix)
            assignment = self._assignment_now = self._assignment(info, restarts, addr)
            self._emit("round_joined", round=info.round, rank=info.rank, world=info.world_size)
            coord = RoundCoordinator(handler.store, info.store, handler.node_id, on_failure=group.wake,
                                     signer=handler.signer, where=(handler.prefix, info.store_prefix))
            watch = MembershipWatch(handler, info, on_change=group.wake)
            keep_asked, self._keep = self._keep, False
            cooperative = False
            try:
                extra, kept = self._begin_inplace(info, addr, restarts, keep_asked, previous)
                if kept:
                    group.reassign(assignment, extra)
                    assert self._inplace is not None
                    self._emit("workers_kept", generation=self._inplace.gen, pids=group.pids(),
                               world_size=assignment.global_world_size)
                else:
                    if group.running:  # kept, but the round starts afresh (its host is gone)
                        group.stop()
                        self._emit("workers_stopped", reason="inplace_host_lost")
                    group.start(self.attempts, assignment, extra)
                    assert self.watchdog is not None
                    self.watchdog.arm(group.pids(), assignment, group.attempt_dir)
                    self.attempts += 1
                    self._emit("workers_started", attempt=self.attempts - 1, restart_count=restarts,
                               pids=group.pids(), world_size=assignment.global_world_size,
                               run_dir=str(group.run_log_dir))
                    if self._inplace is not None and self._inplace.pending is not None:
                        info.store.set(started_key(handler.node_id), b"1")  # joined in place
                ran = True
                outcome, failed = self._monitor(coord, watch)
                cooperative = (outcome == _Outcome.MEMBERSHIP and self._inplace is not None
                               and self._inplace.cooperative())
            finally:
                watch.stop()
                if self._inplace is not None:
                    self._inplace.close()
            coord.stop()
            self._lingering += [watch, coord]
            if outcome == _Outcome.SIGNAL:
                return self._signalled()
            if outcome == _Outcome.MEMBERSHIP:
                cause = watch.cause
                self._emit("membership_changed", reason=watch.reason, cause=cause)
                if (cooperative and cause in ("lost_node", "node_joined")
                        and len(group.running) == cfg.spec.local_world_size):
                    # In place: the workers run on (or wait, when a peer node is gone) while
                    # the next round forms, then re-form with the new world.
                    self._keep = True
                    continue
                group.stop()
                self._emit("workers_stopped", reason="membership_changed")
                if watch.store_error is not None:
                    raise watch.store_error
                continue
            if outcome == _Outcome.SUCCEEDED:
                finished, lost = self._exit_barrier(coord, info)
                if finished:
                    try:
                        handler.shutdown("finished")
                    except StoreError:
                        pass  # a peer already closed the job and the store went with its host
                    coord.depart(info.world_size, cfg.hosts_store, cfg.rdzv.heartbeat_timeout + 5,
                                 lost=len(lost))
                    results = group.results
                    restarts = restart_count(handler.store)  # in-place recoveries count too
                    self._emit("job_finished", restarts=restarts)
                    return AgentResult("succeeded", 0, "all workers finished",
                                       return_values={lr: r.return_value for lr, r in results.items()},
                                       restarts=restarts, attempts=self.attempts)
                outcome = _Outcome.PEER_FAILURE  # a peer failed while we waited: restart with it
            decision = self._after_failure(outcome, failed, coord, restarts)
            if decision is None:
                continue  # the node that failed first died before deciding: re-form without it
            if decision.action == "give_up":
                handler.shutdown(f"failed: {decision.reason}")
                report = self._report(restarts) if outcome == _Outcome.LOCAL_FAILURE else None
                self._emit("job_failed", reason=decision.reason)
                note = coord.failure_note()
                where = "" if note is None or note.node_id == handler.node_id else f" (first failure on node {note.node_id}: {note.headline})"
                return AgentResult("failed", 1, decision.reason + where, report=report,
                                   restarts=restarts, attempts=self.attempts)
            self._emit("restart", restart_count=decision.restart_count, delay_s=decision.delay_s, reason=decision.reason)
            if decision.delay_s > 0:
                time.sleep(decision.delay_s)

    def _exit_barrier(self, coord: RoundCoordinator, info: RoundInfo) -> tuple[bool, list[str]]:
        """The exit barrier, watching heartbeats meanwhile: a peer lost after this node's
        workers finished ends the wait after ``heartbeat_timeout``, not the barrier's timeout.
        Returns (finished, the lost peers' node ids)."""
        assert self.handler is not None
        try:
            watch = MembershipWatch(self.handler, info)
        except StoreError:  # no second connection to the store: wait as before, unwatched
            return coord.exit_barrier(info.world_size, self.config.exit_barrier_timeout), []
        self._lingering.append(watch)  # joined before the process exits, as the round's are
        try:
            finished = coord.exit_barrier(info.world_size, self.config.exit_barrier_timeout,
                                          lost=lambda: watch.reason if watch.lost else None)
        finally:
            watch.stop()
        if watch.lost:
            self._emit("exit_barrier_left", lost=",".join(watch.lost), reason=watch.reason)
        return finished, list(watch.lost)

    def _monitor(self, coord: RoundCoordinator, watch: MembershipWatch) -> tuple[int, list[WorkerResult]]:
        """Block until something needs the loop's attention; all wake-ups are events."""
        assert self.group is not None
        group = self.group
        while True:
            inplace = self._inplace
            exited = group.wait_any(timeout=5.0 if inplace is None else inplace.wait_timeout(5.0))
            self._emit_expiries()
            failed = [r for r in exited if r.failed]
            if failed and inplace is not None and not coord.failed.is_set():
                assert self.watchdog is not None
                for r in failed:
                    self.watchdog.forget(r.local_rank)
                if inplace.on_failures(failed):
                    assert self._assignment_now is not None
                    for r in failed:  # the replacements' timers are watched like the others'
                        self.watchdog.replace(r.local_rank, group.pids()[r.local_rank],
                                              self._assignment_now, group.attempt_dir)
                    continue  # replaced in place; the other workers keep running
                if inplace.decision is not None and inplace.decision.action == "restart":
                    return _Outcome.INPLACE_FALLBACK, failed
            if failed:
                return _Outcome.LOCAL_FAILURE, failed
            if inplace is not None and inplace.poll():
                return _Outcome.INPLACE_FALLBACK, []
            if self._signal is not None:
                if self._signal in TERMINATING:
                    return _Outcome.SIGNAL, []
                group.signal_all(self._signal)
                self._signal = None
                continue
            if coord.failed.is_set():
                return _Outcome.PEER_FAILURE, []
            if watch.changed.is_set():
                return _Outcome.MEMBERSHIP, []
            if not group.running:
                return _Outcome.SUCCEEDED, []

    def _after_failure(self, outcome: int, failed: list[WorkerResult], coord: RoundCoordinator,
                       restarts: int) -> Decision | None:
        assert self.group is not None
        if outcome == _Outcome.INPLACE_FALLBACK:
            # In-place recovery did not come together: restart everything, as restart-all
            # would have, on the budget already charged for this failure.
            assert self._inplace is not None
            coord.report_failure(f"node {self.node_id}: in-place recovery failed")
            self.group.stop()
            self._emit("workers_stopped", reason="inplace_fallback")
            decision = self._inplace.fallback_decision()
            coord.round.set("decision", decision.to_json())
            return decision
        if outcome == _Outcome.LOCAL_FAILURE:
            first = min(failed, key=lambda r: r.ended_at)
            self._emit_expiries()  # the reaper records an expiry before it kills
            hang = self.watchdog.expiry_of(first.pid) if self.watchdog is not None else None
            why = hang.headline() + " (watchdog timer expired)" if hang is not None else first.describe()
            won = coord.report_failure(f"node {self.node_id}: {why}")
            extra: dict[str, Any] = {"cause": "timer_expired", "timer_scope": hang.scope} if hang else {}
            self._emit("worker_failed", rank=first.rank, local_rank=first.local_rank,
                       exit=first.signal_name or f"code {first.exitcode}", first_in_job=won, **extra)
            self.group.stop()
            self._emit("workers_stopped", reason="worker_failed")
            if won:
                report = self._report(restarts)
                root = report.root_cause
                cause = root.cause() if root is not None else first.describe()
                return coord.decide(self.config.policy, cause)
        else:
            note = coord.failure_note()
            self._emit("peer_failed", by=None if note is None else note.node_id)
            self.group.stop()
            self._emit("workers_stopped", reason="peer_failed")
        return coord.await_decision(self.config.decision_timeout)

    def _begin_inplace(self, info: RoundInfo, addr: str, restarts: int, keep: bool,
                       previous: RoundInfo | None) -> tuple[dict[str, str], bool]:
        """In-place mode: the round's generations and the workers' extra environment; True
        when this agent's running workers carry on into the round (``keep`` asked for it and
        the round's setup agreed)."""
        self._inplace = None
        if self.config.recovery != "in-place":
            return {}, False
        assert self.handler is not None and self.group is not None
        node_id = self.handler.node_id
        if self._inplace_host is None:
            self._inplace_host = InPlaceHost(addr, node_id)
        members = sorted(info.members, key=lambda m: m.rank)
        ranges = self._node_ranges(info)
        nodes = {m.node_id: r.base_global_rank for m, r in zip(members, ranges)}
        world = ranges[0].global_world_size
        first = Generation(0, world, restarts, "nodes changed" if keep else "start", nodes)
        setup = self._inplace_host.agree(
            self.handler.store, info, keep=keep,
            fresh_prefix=round_prefix(self.config.rdzv.job_id, info.round, self.attempts),
            first=first, timeout=self.config.rdzv.join_timeout,
            start_timeout=self.config.reform_timeout, joining=[
                m.node_id for m in info.members
                if previous is None or m.node_id not in {p.node_id for p in previous.members}])
        self._inplace = InPlaceRound(
            self.group, self.handler.store, self.config.policy, setup, world, nodes,
            reform_timeout=self.config.reform_timeout,
            error_grace=self.config.rdzv.heartbeat_timeout + 5, emit=self._emit)
        return self._inplace.env(node_id, setup.gen), keep and setup.keep

    def _report(self, restarts: int) -> FailureReport:
        assert self.group is not None
        results = list(self.group.results.values())
        return FailureReport.collect(results, stopped=[r.local_rank for r in results if r.stopped],
                                     restart_count=restarts,
                                     hangs=self.watchdog.hangs() if self.watchdog is not None else None)

    def _signalled(self) -> AgentResult:
        assert self.group is not None and self.handler is not None
        sig = self._signal or signal.SIGTERM
        name = signal.Signals(sig).name
        self._emit("signalled", signal=name)
        self.group.stop(sig=sig)
        return AgentResult("signalled", 128 + sig, f"agent received {name}; workers stopped",
                           attempts=self.attempts)

    # -- helpers ----------------------------------------------------------------------------
    def _assignment(self, info: RoundInfo, restarts: int, addr: str) -> Assignment:
        cfg = self.config
        ranks = self._node_ranges(info)
        master_addr, master_port = self._master(info, addr)
        return Assignment.from_node_ranks(
            info.rank, info.world_size, ranks[info.rank], master_addr=master_addr,
            master_port=master_port, run_id=cfg.rdzv.job_id, restart_count=restarts,
            max_restarts=cfg.max_restarts, use_agent_store=False,
        )

    def _node_ranges(self, info: RoundInfo) -> list[NodeRanks]:
        """Every member's rank range, in group-rank order (torchrun's assignment)."""
        spec = self.config.spec
        members = sorted(info.members, key=lambda m: m.rank)
        return assign_ranks([(str(m.meta.get("role", spec.role)), int(m.meta.get("nproc", spec.local_world_size)))
                             for m in members])

    def _master(self, info: RoundInfo, addr: str) -> tuple[str, int]:
        """Group rank 0 picks MASTER_ADDR/PORT for the workers' own store and tells the others."""
        if info.rank == 0:
            port = free_port(addr if is_ip(addr) else "0.0.0.0")
            info.store.set("master", f"{addr} {port}".encode())
            return addr, port
        host, port = info.store.get("master", self.config.rdzv.join_timeout).decode().split()
        return host, int(port)

    def _wake(self) -> None:
        if self.group is not None:
            self.group.wake()

    def _emit_expiries(self) -> None:
        """Events for timers the reaper caught since the last look (it runs on its own thread)."""
        if self.watchdog is None:
            return
        for e in self.watchdog.take_new():
            self._emit("timer_expired", rank=e.rank, local_rank=e.local_rank, pid=e.pid, scope=e.scope,
                       where=e.where, late_ms=round(e.late_s * 1e3, 1), report=e.report_path)

    def _emit(self, kind: str, **fields: Any) -> None:
        log.info("%s %s", kind, " ".join(f"{k}={v}" for k, v in fields.items()))
        if self.config.on_event is not None:
            self.config.on_event(kind, **fields)

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handle(signum: int, _frame: Any) -> None:
            self._signal = signum
            if self.group is not None:
                self.group.wake()

        for sig in FORWARDED:
            self._old_handlers[sig] = signal.signal(sig, handle)

    def _restore_signals(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

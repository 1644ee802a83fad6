"""Agent side of ``--recovery in-place``: replace only the failed worker, keep the others.

Erlang/OTP would call restart-all ``one_for_all`` and this ``one_for_one``. Per rendezvous
round the agent of group rank 0 hosts an *in-place store* (a TCPStore in the agent, so it
outlives any worker, unlike the one rank 0's worker hosts for a torchrun-style script) and
publishes generation 0 there; workers find it through ``ELASTICTK_INPLACE_STORE``/``_PREFIX``
(``elastictk.inplace.run_elastic`` uses it; a plain script ignores it).

When a local worker fails:

1. the failure is charged to the job's restart budget exactly as restart-all charges it (one
   failure, one restart; the same ``--max-restarts``, intensity and job-wide state in the store);
2. the failed local rank is started again from the preload fork server, with
   ``TORCHELASTIC_RESTART_COUNT`` = the job's new restart count: the server's hot standby (a
   process forked and warmed ahead of need) becomes it, or, with none at hand, a fresh fork;
3. the next generation is published (the survivors, blocked on it after their collective
   failed, re-form their process group under its fresh prefix and send the replacement the state).

A hung worker (SIGSTOP, a debugger, a stuck driver) makes the others' collectives time out; the
first to time out writes the generation's ``error`` key, which wakes the agent: it kills its
local workers that are frozen (process state ``T``/``t`` in ``/proc``), naming each as
restart-all's watchdogs do (stacks dumped first, then a ``hang_detected`` event with its rank),
and their exit takes the path above. If the new generation is not ready within
``reform_timeout`` (survivors wedged in a backend call, a plain script that exits instead of
re-forming, or errors with nobody to blame), the agent falls back to restart-all, without
charging the budget a second time. That bound is
counted in an idle host's seconds (:mod:`elastictk.lifetime.busyclock`): a host whose cores are
all busy stretches it (up to 4x), since healthy forming is slower there and a wedge is not.

Nodes joining or leaving (a new rendezvous round) do not stop the workers either: each agent
keeps its running workers through the round (``ElasticAgent`` asks ``InPlaceRound.cooperative``
first), and the agent hosting the in-place store, which stays the host while it is a member,
publishes a generation with the new world size and every node's first rank (``Setup``, agreed
through the round's store). A lost node costs the survivors one rollback; joining nodes start
their workers before the generation is published, so the kept ones train on meanwhile. Neither
is charged to the restart budget, as in restart-all.

``TORCHELASTIC_RESTART_COUNT``: a process sees the job's restart count *at its own start*.
Survivors of an in-place recovery keep the value they started with; the current count is in
the generation record (``ctx.restart_count`` in ``run_elastic``).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from ..inplace.protocol import (
    ENV_FIRST_GEN, ENV_KEY, ENV_NODE, ENV_PREFIX, ENV_STORE, Generation, Sealer, error_key, gen_key,
    joined_key, newest_sealed, publish, ready_key, ready_time, round_prefix,
)
from ..lifetime.busyclock import BusyDeadline
from ..lifetime.procfs import is_frozen
from ..rendezvous import RoundInfo
from ..metrics.kinds import Emit, EventKind
from ..store import PrefixStore, Store, StoreError, StoreTimeout, TCPStore
from ..supervisor.env import NodeRanks
from ..supervisor.group import WorkerGroup
from ..supervisor.spec import WorkerResult
from .config import AgentConfig
from .coordination import Budget, Decision, node_ranges, records_of
from .inplace_host import InPlaceHost, Setup, inplace_key
from .outcome import DecisionAction
from .unformed import joined_count, report_unformed, summary
from .hang import Hang, declare_frozen
from .policy import RestartPolicy

log = logging.getLogger("elastictk.agent")

DEFAULT_REFORM_TIMEOUT = 30.0


def spend_restart(job: Store | Budget, policy: RestartPolicy, cause: str) -> Decision:
    """Charge one failure to the job-wide restart budget; compare-and-set, so agents failing at
    the same moment each charge theirs (restart-all's winner-decides needs no loop). ``job``:
    the agent's :class:`Budget` (sealed with the job token, the same record restart-all
    charges), or a bare store (no token)."""
    budget = job if isinstance(job, Budget) else Budget(records_of(job))
    return budget.spend(policy, cause)


def begin_round(host: InPlaceHost, group: WorkerGroup, budget: Budget, cfg: AgentConfig, info: RoundInfo,
                node_id: str, *, restarts: int, keep: bool, previous: Optional[RoundInfo], attempt: int,
                emit: Emit) -> tuple["InPlaceRound", dict[str, str], bool]:
    """:func:`open_round` with the agent's settings: the round, the workers' extra environment,
    and True when this agent's running workers carry on into it (``keep`` asked for it and
    the round's setup agreed)."""
    rnd, setup = open_round(
        host, group, budget, cfg.policy, info, node_ranges(info, cfg.spec.role, cfg.spec.local_world_size),
        restarts=restarts, keep=keep, previous=previous,
        fresh_prefix=round_prefix(cfg.rdzv.job_id, info.round, attempt),
        join_timeout=cfg.rdzv.join_timeout, reform_timeout=cfg.reform_timeout,
        error_grace=cfg.rdzv.heartbeat_timeout + 5, emit=emit, standby=cfg.standby)
    return rnd, rnd.env(node_id, setup.gen), keep and setup.keep


def open_round(host: InPlaceHost, group: WorkerGroup, job: Store | Budget, policy: RestartPolicy, info: RoundInfo,
               ranges: list[NodeRanks], *, restarts: int, keep: bool, previous: Optional[RoundInfo],
               fresh_prefix: str, join_timeout: float, reform_timeout: float, error_grace: float,
               emit: Emit, standby: bool = True) -> tuple["InPlaceRound", Setup]:
    """One round's generations, and the setup agreed with the round's other agents
    (``ranges``: every member's ranks, in group-rank order). ``standby``: the preload server
    keeps a warmed process that the next replacement becomes (no fork, no start-up)."""
    if standby:
        group.keep_standby()
    members = sorted(info.members, key=lambda m: m.rank)
    nodes = {m.node_id: r.base_global_rank for m, r in zip(members, ranges)}
    world = ranges[0].global_world_size
    first = Generation(0, world, restarts, "nodes changed" if keep else "start", nodes)
    before = set() if previous is None else {p.node_id for p in previous.members}
    records = job.records if isinstance(job, Budget) else records_of(job)
    setup = host.agree(records, info, keep=keep, fresh_prefix=fresh_prefix, first=first, timeout=join_timeout,
                       start_timeout=reform_timeout,
                       joining=[m.node_id for m in info.members if m.node_id not in before])
    return InPlaceRound(group, job, policy, setup, world, nodes, reform_timeout=reform_timeout,
                        error_grace=error_grace, emit=emit,
                        base_rank=ranges[info.rank].base_global_rank), setup


class InPlaceRound:
    """One rendezvous round's generations, as one agent sees and drives them."""

    def __init__(self, group: WorkerGroup, job: Store | Budget, policy: RestartPolicy, setup: Setup,
                 world_size: int, nodes: dict[str, int], *,
                 reform_timeout: float = DEFAULT_REFORM_TIMEOUT, error_grace: float = 0.0,
                 emit: Emit, base_rank: int = 0) -> None:
        self.group = group
        self.job = job if isinstance(job, Budget) else Budget(records_of(job))
        self.policy = policy
        self.endpoint = setup.endpoint
        self.prefix = setup.prefix
        self.world_size = world_size
        self.nodes = dict(nodes)
        self.reform_timeout = reform_timeout
        self.error_grace = error_grace
        self.emit = emit
        self.base_rank = base_rank  # this node's first global rank: local rank + it names a rank
        self.hangs: dict[int, Hang] = {}  # PID -> the hang it was killed for (this round)
        # With a job token: the records here are sealed with the run's in-place key (the
        # workers get that key, never the token); one that does not verify is absent.
        self._key = inplace_key(self.job.records.signer)
        self.sealer = Sealer(self._key, setup.prefix)
        self._conn = TCPStore.connect(setup.endpoint)
        self.store: Store = PrefixStore(setup.prefix, self._conn)
        self.gen = setup.gen
        self.decision: Optional[Decision] = None  # the charge of the recovery in flight
        self.failures: list[WorkerResult] = []
        self.deadline: Optional[BusyDeadline] = None  # in an idle host's seconds: load stretches it
        self._recovery_started = 0.0  # monotonic, and the same moment by the wall clock:
        self._recovery_wall = 0.0  # the workers stamp the ready key with the wall clock
        self.pending: Optional[int] = None  # the generation being formed
        self._pending_kind = EventKind.INPLACE_RECOVERED
        self._lock = threading.Lock()
        self._errors = threading.Event()
        self._ready = threading.Event()
        self._stop = threading.Event()
        if setup.keep:  # nodes joined or left: the kept workers re-form in this generation
            self.pending, self._pending_kind = setup.gen, EventKind.INPLACE_RESIZED
            self._begin_deadline()
        self._watcher = threading.Thread(target=self._watch, name="elastictk-inplace-watch",
                                         daemon=True)
        self._watcher.start()

    def env(self, node_id: str, first_gen: int) -> dict[str, str]:
        env = {ENV_STORE: self.endpoint, ENV_PREFIX: self.prefix, ENV_NODE: node_id,
               ENV_FIRST_GEN: str(first_gen)}
        if self._key is not None:
            env[ENV_KEY] = self._key
        return env

    # -- generations --------------------------------------------------------------------------
    def _next(self, restart_count: int, reason: str) -> int:
        store = self.store
        return publish(self.sealer, store.try_get, store.compare_set, self.gen,
                       lambda g: Generation(g, self.world_size, restart_count, reason, self.nodes))

    def cooperative(self) -> bool:
        """Whether the workers re-form in place at all (``run_elastic`` marks each generation
        ready; a plain script never does): only then can they be kept through a change of
        nodes."""
        try:
            return any(self._read(ready_key(g)) is not None for g in range(self.gen + 1))
        except StoreError:
            return False

    def _watch(self) -> None:
        """Wake the agent when the current generation reports an error or the pending one is
        ready; store waits (0.1 s at a time, to re-arm), so it reacts as the key appears.
        It also follows generations another node's agent published (multi-node jobs)."""
        store = self._conn.clone()
        seen_error = -1
        try:
            while not self._stop.is_set():
                with self._lock:
                    latest = self._published(store)
                    if latest > self.gen and self.pending is not None and (
                            self._ready.is_set() or self._ready_in(store, self.pending)):
                        # The generation being formed did form (a newer record, e.g. the
                        # workers' "finished", followed at once): report it before moving on.
                        if not self._ready.is_set():
                            self._ready.set()
                            self.group.wake()
                        latest = self.gen
                    if latest > self.gen:  # another agent replaced one of its workers
                        self.gen = self.pending = latest
                        self._pending_kind = EventKind.INPLACE_RECOVERED
                        self._ready.clear()
                        self._begin_deadline()
                    g, pending = self.gen, self.pending
                if pending is not None and not self._ready.is_set():
                    key = ready_key(pending)
                elif seen_error != g:
                    key = error_key(g)
                else:
                    self._stop.wait(0.1)
                    continue
                try:
                    store.wait([f"{self.prefix}/{key}"], 0.1)
                except StoreTimeout:
                    continue
                if self.sealer.enabled and self.sealer.open(key, store.try_get(f"{self.prefix}/{key}")) is None:
                    self._stop.wait(0.1)  # present but forged: absent; poll for the real one
                    continue
                if key == error_key(g):
                    seen_error = g
                    self._errors.set()
                else:
                    self._ready.set()
                self.group.wake()
        except StoreError as e:
            # The store is gone with its host; membership and heartbeats report that.
            log.info("in-place watch ended: %s", e)
        except Exception as e:  # noqa: BLE001 - never silently: the agent treats it as an error
            log.warning("in-place watch stopped by %r; taken as an error of generation %d", e, self.gen)
            self._errors.set()
            self.group.wake()
        finally:
            store.close()

    def _ready_in(self, store: Store, g: int) -> bool:
        key = ready_key(g)
        return self.sealer.open(key, store.try_get(f"{self.prefix}/{key}")) is not None

    def _published(self, store: Store) -> int:
        """The newest generation another agent has published, else ours (:func:`newest`: one
        read when there is none); a record that does not verify (token jobs) is not there, so
        nothing a stranger writes moves anybody."""
        return newest_sealed(self.sealer, lambda key: store.try_get(self.sealer.name(key)), self.gen)

    def _begin_deadline(self, timeout: Optional[float] = None, since: Optional[float] = None) -> None:
        """Arm (or re-arm) the re-form deadline; a recovery not yet timed starts at ``since``
        (monotonic; default now)."""
        if self.deadline is None:
            self._started(time.monotonic() if since is None else since)
        self.deadline = BusyDeadline(self.reform_timeout if timeout is None else timeout)

    # -- what the agent's monitor calls -------------------------------------------------------
    def on_failures(self, failed: list[WorkerResult]) -> bool:
        """Replace ``failed`` in place; False when the job must take the restart-all path
        instead (a worker already finished, the budget is spent, a replacement cannot start)."""
        if self.pending is not None and self._formed(self.pending):
            # The generation formed before these failures (the monitor had not yet seen the
            # watcher's wake-up): they are new failures, charged and replaced as such.
            self._complete_pending()
        if self.pending is not None:
            # A failure while the last recovery is still forming: the workers are not
            # re-forming (a plain script exits on a peer's death) or keep failing. Restart
            # everything, on the budget that recovery already charged.
            for r in failed:
                self.emit(EventKind.WORKER_FAILED, rank=r.rank, local_rank=r.local_rank,
                          exit=r.signal_name or f"code {r.exitcode}", recovery="in-place")
            self.emit(EventKind.INPLACE_FALLBACK, reason=f"{len(failed)} more worker(s) failed while "
                      f"generation {self.gen} was forming")
            self.failures.extend(failed)
            self.fallback_decision()
            return False
        self.decision = None
        results = self.group.results
        if any(r.exitcode == 0 for r in results.values()):
            return False  # the job is finishing; a lone replacement would wait for the others
        try:
            self.store.try_get(gen_key(self.gen))  # the in-place store is still there
        except StoreError as e:
            # The in-place store died with its host's agent (the likely cause of these
            # failures): nobody can re-form in place. Restart-all decides, charging once.
            self.emit(EventKind.INPLACE_FALLBACK, reason=f"the in-place store is unreachable: {e}")
            return False
        first = min(failed, key=lambda r: r.ended_at)
        for r in failed:
            hung = {"cause": "hang_detected"} if r.pid in self.hangs else {}
            self.emit(EventKind.WORKER_FAILED, rank=r.rank, local_rank=r.local_rank,
                      exit=r.signal_name or f"code {r.exitcode}", recovery="in-place", **hung)
        self.failures.extend(failed)
        hang = self.hangs.get(first.pid)
        decision = spend_restart(self.job, self.policy, hang.headline() if hang is not None else first.describe())
        self.decision = decision
        if decision.action != DecisionAction.RESTART:
            return False
        t0 = time.monotonic()
        pids = {}
        gen = self.gen + 1
        try:
            for r in failed:
                # Its first generation is the one about to be published: a replacement that starts
                # before the record is there (a standby is quick, the agent's thread may wait for
                # the CPU) must wait for it, not join the round's older generation, whose group
                # is gone (it would dial the survivors' closed listeners while they wait for it
                # in the new one).
                pids[r.local_rank] = self.group.respawn(r.local_rank, decision.restart_count,
                                                        f"gen_{gen}", env={ENV_FIRST_GEN: str(gen)})
        except Exception as e:  # noqa: BLE001 - any start failure means: restart everything
            self.emit(EventKind.INPLACE_FALLBACK, reason=f"cannot start a replacement: {e}")
            return False
        # The start phase ends here, before the generation is published: the workers may form it
        # (and stamp its ready key) while this thread still waits for the lock or the CPU, and a
        # start measured after that outgrew the whole recovery on a loaded host (75 ms of 59).
        spawn_ms = round((time.monotonic() - t0) * 1000, 1)
        with self._lock:
            try:
                self.gen = self.pending = self._next(decision.restart_count, first.describe())
            except StoreError as e:  # lost since the check above: restart on this charge
                self.emit(EventKind.INPLACE_FALLBACK, reason=f"the in-place store is unreachable: {e}")
                return False
            self._pending_kind = EventKind.INPLACE_RECOVERED
            self._ready.clear()
            self._errors.clear()
            self._begin_deadline(since=t0)  # the recovery began as its replacements began to start
        self.emit(EventKind.INPLACE_RECOVERY, generation=self.gen, restart_count=decision.restart_count,
                  replaced=pids, spawn_ms=spawn_ms,
                  standby=[lr for lr, pid in pids.items() if pid in self.group.from_standby])
        return True

    def poll(self) -> bool:
        """Handle what the watcher saw; True when in-place recovery failed (fall back)."""
        if self._errors.is_set():
            self._errors.clear()
            self._kill_frozen()
            if self.deadline is None:
                # Errors, but nothing died here: a worker elsewhere is being replaced, or a
                # node is gone and the membership watch will say so within error_grace.
                self._begin_deadline(max(self.reform_timeout, self.error_grace))
        if self._ready.is_set() and self.pending is not None:
            self._complete_pending()
        if self.deadline is not None and self.deadline.expired():
            self.emit(EventKind.INPLACE_FALLBACK, reason=self._unformed(self.deadline.describe()))
            return True
        return False

    def _unformed(self, waited: str) -> str:
        """The fallback's reason, after the report of how far the generation got and where
        each local worker was (the fallback kills them, and the evidence with them)."""
        try:
            joined = joined_count(self.store.try_get(joined_key(self.gen)))
        except StoreError:
            joined = None
        pids = {lr: pid for lr, pid in self.group.pids().items() if lr in self.group.running}
        path = report_unformed(self.group.attempt_dir, self.gen, joined, self.world_size, pids,
                               {lr: self.base_rank + lr for lr in pids}, waited)
        where = f"; this node's workers' stacks in {path}" if path else ""
        return f"generation {self.gen} not ready within {waited}: {summary(self.gen, joined, self.world_size)}{where}"

    def _kill_frozen(self) -> None:
        """The group's collective failed: a local worker stopped (state T) is the hang that
        timed it out. Named as restart-all's watchdogs name a hang: its stacks dumped (before
        the kill), a ``hang_detected`` event with its rank, then SIGKILL; its exit takes the
        replacement path, charged with the hang's headline."""
        pids = {lr: pid for lr, pid in self.group.pids().items() if lr in self.group.running}
        frozen = sorted(lr for lr, pid in pids.items() if is_frozen(pid))
        if not frozen:
            return
        hang = declare_frozen(pids, {lr: self.base_rank + lr for lr in pids}, frozen,
                              self.group.attempt_dir)
        for c in hang.culprits:
            self.hangs[c.pid] = hang
        log.warning("%s", hang.describe())
        self.emit(EventKind.HANG_DETECTED, **hang.fields())
        for lr in frozen:
            self.emit(EventKind.WORKER_FROZEN, local_rank=lr, pid=pids[lr], action="SIGKILL")
            self.group.signal_one(lr, 9)

    def settle(self) -> None:
        """Every worker finished: a generation that formed meanwhile is reported now (its ready
        record is in the store), though the watcher had not woken the agent for it yet. A job
        with few steps left after a recovery finishes within the watcher's re-arm."""
        if self.pending is not None and self._formed(self.pending):
            self._complete_pending()

    def _formed(self, g: int) -> bool:
        """Whether generation ``g`` is ready, asking the store itself: the watcher's event may
        lag the workers by a wake-up."""
        if self._ready.is_set():
            return True
        try:
            return self._read(ready_key(g)) is not None
        except StoreError:
            return False

    def _read(self, key: str) -> Optional[bytes]:
        """A record of the in-place store; None when absent or (token) it does not verify."""
        return self.sealer.open(key, self.store.try_get(key))

    def _started(self, at: float) -> None:
        self._recovery_started = at
        self._recovery_wall = time.time() - (time.monotonic() - at)

    def _took(self, g: int) -> float:
        """Seconds from the recovery's start until generation ``g`` formed: the ready key's
        stamp when it has one, since this agent may notice it a watcher re-arm (0.1 s) late."""
        took = time.monotonic() - self._recovery_started
        try:
            formed = ready_time(self._read(ready_key(g)))
        except StoreError:
            formed = None
        if formed is not None:  # another host's clock may be off: never beyond what we saw
            took = min(took, max(0.0, formed - self._recovery_wall))
        return took

    def _complete_pending(self) -> None:
        assert self.pending is not None
        self.emit(self._pending_kind, generation=self.pending, pids=self.group.pids(),
                  world_size=self.world_size, took_ms=round(self._took(self.pending) * 1000, 1))
        with self._lock:
            self.deadline = self.pending = None
            self._ready.clear()

    def fallback_decision(self) -> Decision:
        """What restart-all does now: the charge already made for this recovery, or (errors
        but no failure to blame) a new one."""
        if self.decision is None:
            self.decision = spend_restart(self.job, self.policy,
                                          f"generation {self.gen} did not re-form in place")
        return self.decision

    def wait_timeout(self, default: float) -> float:
        if self.deadline is None:
            return default
        return min(default, self.deadline.remaining())

    def close(self) -> None:
        self._stop.set()
        self._watcher.join(timeout=5)
        self._conn.close()

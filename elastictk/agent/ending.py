"""How a job ends on this node other than by a failure: finished, finished elsewhere, signalled.

Apart from the loop (``elastic.py``) and the failure path (``failure.py``) because it is what
a reader looks for when a job does not exit as expected. Finished: this node's workers have
all finished, and it waits in the exit barrier for every other node's (a peer lost meanwhile
ends the wait after ``heartbeat_timeout``, not the barrier's timeout), marks the job finished
so late joiners are told, and leaves the store in the order its host needs
(``RoundCoordinator.depart``); a peer that failed during the wait is not an end (the caller
treats it as a peer's failure). Finished elsewhere: the job was closed before this node got a
round (a late node, or a relaunch under a used ``--rdzv-id``). Signalled: a terminating signal
stops the workers, the pre-emption signal gives them their grace first (``preempt.py``).
"""
from __future__ import annotations

import logging
import signal
from typing import Callable, Mapping

from ..metrics.kinds import Emit, EventKind
from ..rendezvous import MembershipWatch, RendezvousClosed, RendezvousError, RendezvousHandler, RoundInfo
from ..snapshot.settings import ENV_DIR
from ..store import StoreError
from ..supervisor.group import WorkerGroup
from ..supervisor.spec import WorkerResult
from .config import AgentConfig
from .coordination import RoundCoordinator
from .outcome import AgentResult, ResultState
from .preempt import preempt

log = logging.getLogger("elastictk.agent")


def exit_barrier(handler: RendezvousHandler, coord: RoundCoordinator, info: RoundInfo, timeout: float,
                 stop_reason: Callable[[], str | None], emit: Emit,
                 linger: Callable[[MembershipWatch], None]) -> tuple[bool, list[str]]:
    """The exit barrier, watching heartbeats meanwhile: a peer lost after this node's workers
    finished ends the wait after ``heartbeat_timeout``, not the barrier's timeout; a
    terminating signal (``stop_reason``) ends it too. Returns (finished, the lost peers' node
    ids); the watch is handed to ``linger`` (joined before the process exits)."""
    try:
        watch = MembershipWatch(handler, info)
    except StoreError:  # no second connection to the store: wait as before, unwatched
        return coord.exit_barrier(info.world_size, timeout, lost=stop_reason,
                                  members=[m.node_id for m in info.members]), []
    linger(watch)  # joined before the process exits, as the round's are
    try:
        finished = coord.exit_barrier(info.world_size, timeout,
                                      lost=lambda: stop_reason() or (watch.reason if watch.lost else None),
                                      members=[m.node_id for m in info.members])
    finally:
        watch.stop()
    if watch.lost:
        emit(EventKind.EXIT_BARRIER_LEFT, lost=",".join(watch.lost), reason=watch.reason)
    return finished, list(watch.lost)


def job_finished(handler: RendezvousHandler, coord: RoundCoordinator, info: RoundInfo, cfg: AgentConfig,
                 results: Mapping[int, WorkerResult], emit: Emit, lost: int, attempts: int) -> AgentResult:
    """Every node finished: the job is marked finished (late joiners are told), this node
    departs the round's store, and the agent's result carries each worker's return value."""
    try:
        handler.shutdown("finished")
    except StoreError:
        pass  # a peer already closed the job and the store went with its host
    coord.depart(info.world_size, cfg.hosts_store, cfg.rdzv.heartbeat_timeout + 5, lost=lost,
                 members=[m.node_id for m in info.members])
    restarts = coord.budget.restart_count()  # in-place recoveries count too
    emit(EventKind.JOB_FINISHED, restarts=restarts)
    return AgentResult(ResultState.SUCCEEDED, 0, "all workers finished",
                       return_values={lr: r.return_value for lr, r in results.items()},
                       restarts=restarts, attempts=attempts)


def closed_elsewhere(e: RendezvousClosed, group: WorkerGroup, ran: bool, job_id: str, emit: Emit,
                     attempts: int) -> AgentResult:
    """The job was closed while this node waited for a round: a failure once this node ran
    workers; else it ran nothing, which is success only where the job succeeded."""
    if group.running:
        group.stop()  # kept for an in-place change that will not come
    if ran:
        return AgentResult(ResultState.FAILED, 1, str(e), attempts=attempts)
    emit(EventKind.JOB_FINISHED_ELSEWHERE, message=str(e), succeeded=e.succeeded)
    ran_nothing = (f"{e}; this node ran nothing (to run job {job_id!r} "
                   "again, launch it with a fresh --rdzv-id)")
    if not e.succeeded:  # a late node, or a relaunch of a failed job, must not say success
        return AgentResult(ResultState.FAILED, 1, ran_nothing, attempts=attempts)
    return AgentResult(ResultState.FINISHED_ELSEWHERE, 0, ran_nothing, attempts=attempts)


def signalled(group: WorkerGroup, sig: int, cfg: AgentConfig, emit: Emit, attempts: int) -> AgentResult:
    """The agent was told to stop by ``sig``: the workers stopped with it (pre-empted: given
    their grace period first), exit 128 + the signal's number."""
    if sig == cfg.preempt_signal:
        return preempt(group, sig, cfg.spec.grace_period, emit, cfg.spec.env.get(ENV_DIR), attempts)
    name = signal.Signals(sig).name
    emit(EventKind.SIGNALLED, signal=name)
    group.stop(sig=sig)
    return AgentResult(ResultState.SIGNALLED, 128 + sig, f"agent received {name}; workers stopped",
                       attempts=attempts)


def host_leaves_last(handler: RendezvousHandler | None, cfg: AgentConfig, info: RoundInfo | None,
                     result: AgentResult) -> AgentResult:
    """A failed job's store host waits (at most ``heartbeat_timeout + 5`` s) for the last
    round's other nodes to leave before its store goes with it, so each ends with the job's
    own line (a flag that differs between nodes, the decision to give up), not "store lost".
    A job that finished departs through the exit barrier instead; a signalled agent leaves now."""
    if handler is None or info is None or not cfg.hosts_store or result.state != ResultState.FAILED:
        return result
    try:
        others = [m.node_id for m in info.members if m.node_id != handler.node_id]  # read once, here
    except (StoreError, RendezvousError):
        return result
    if others:
        # Leave first (the heartbeat says so): a peer still running its workers learns of the
        # closed job from a membership change, and this node's departure is the change. Still
        # beating, it waited for them while they waited for it, until its bound ran out and its
        # store went with it ("store lost" there instead of the job's line).
        try:
            handler.close(leaving=True)
        except StoreError:
            return result
        still = handler.await_departures(others, cfg.rdzv.heartbeat_timeout + 5)
        if still:
            log.info("leaving the store with %d node(s) still beating: %s", len(still), ", ".join(still[:8]))
    return result

"""The agent's side of excluding a bad host: decide, say why, stay out, rejoin.

The decisions are :mod:`elastictk.agent.exclusion`'s; this is what the agent does with them.

- This node's own verdicts: R failures of its workers within T seconds (``--exclude-after``),
  or its health check failing in a round while exclusion is on. The agent writes the sealed
  record itself, so the job's store says who is out and why.
- The leader's verdict on a straggler (``--straggler-action exclude``): the leader writes the
  sealed record ``exclude/<node_id>`` in the round's store (:mod:`.stragglers`); this node's
  straggler watch reads its own key once per interval and :meth:`ExclusionGate.on_record`
  wakes the agent. A record that does not verify reads as absent: with a job token, nobody
  can exclude a node by writing into the store.

Serving the exclusion (:meth:`ExclusionGate.hold`): stop the workers, one log line and one
``node_excluded`` event, leave the rendezvous on purpose (the heartbeat's LEFT mark, so the
others re-form at once, at a smaller size or with a spare, instead of waiting a heartbeat
timeout for it), then wait out the cooldown on this node's monotonic clock, ending early only
on a terminating signal or the job's sealed shutdown note. The node then rejoins under a new
incarnation of its id (:func:`~elastictk.agent.exclusion.rejoin_id`): the old one was seen
leaving and stays counted as gone.

Leaving a running round costs what a failure costs: the excluded node reports the round's
failure and the job restarts without it, charged to ``--max-restarts`` (as a health check
failing in a round is); the others' own workers would otherwise fail on their own when its
workers stop, in no particular order.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ..metrics.kinds import Emit, EventKind
from ..rendezvous import RendezvousHandler
from ..rendezvous.sealed import Records
from ..supervisor.group import WorkerGroup
from .coordination import Decision, RoundCoordinator
from .health import HealthResult
from .exclusion import Cooldown, Exclusion, ExclusionSettings, FailureWindow, failures_detail, key, rejoin_id
from .outcome import Outcome
from .policy import RestartPolicy

log = logging.getLogger("elastictk.agent")


class ExclusionGate:
    """One agent's exclusions: pending verdicts, the leader's record, the cooldown."""

    def __init__(self, settings: ExclusionSettings | None, emit: Emit, wake: Callable[[], None],
                 min_nodes: int = 1) -> None:
        self.settings = settings
        self.min_nodes = min_nodes
        self._emit, self._wake = emit, wake
        self.window = FailureWindow(*settings.after) if settings is not None and settings.after else None
        self.pending: Exclusion | None = None  # decided, not yet served
        self._records: Records | None = None  # where this node writes its own verdict
        self.flagged = threading.Event()  # the leader's record for this node was read in the round
        self.rejoins = 0
        self._base: str | None = None

    @property
    def on(self) -> bool:
        return self.settings is not None and self.settings.on

    @property
    def stragglers(self) -> bool:
        return self.settings is not None and self.settings.stragglers

    @property
    def cooldown(self) -> float:
        return self.settings.cooldown if self.settings is not None else 0.0

    # -- verdicts ---------------------------------------------------------------------------
    def on_record(self, node_id: str, body: dict[str, Any] | None) -> bool:
        """A (verified) record read from this node's key in the round: whether it excludes the
        node; the agent is woken (called on the straggler watch's thread)."""
        found = Exclusion.from_json(node_id, body)
        if found is None or self.pending is not None:
            return False
        self.pending = found
        self.flagged.set()
        self._wake()
        return True

    def after_round(self, outcome: Outcome, node_id: str, at: float, records: Records,
                    health: HealthResult | None = None) -> None:
        """This node's own verdict once a round ended with ``outcome`` (the job goes on):
        count a local failure at ``at`` (monotonic); a health check that failed in the round
        (``health``: how it failed) excludes while exclusion is on."""
        if self.pending is not None or self.settings is None:
            return
        if outcome == Outcome.LOCAL_FAILURE and self.window is not None and self.window.add(at):
            reason, detail = "failures", failures_detail(self.window)
        elif outcome == Outcome.UNHEALTHY and self.on:
            why = "?" if health is None else f"{health.exit}: {health.line or 'no output'}"
            reason, detail = "health_check", f"its health check failed ({why})"
        else:
            return
        self.pending = Exclusion(node_id, reason, detail, self.settings.cooldown, by=node_id)
        self._records = records

    def leave_round(self, coord: RoundCoordinator, group: WorkerGroup, policy: RestartPolicy,
                    timeout: float) -> Decision | None:
        """The leader excluded this node while its round runs: report the round's failure
        (the job restarts without it), stop the workers, and the job's decision."""
        ex = self.pending
        assert ex is not None
        cause = f"node {ex.node_id} excluded: {ex.detail}"
        won = coord.report_failure(cause)
        group.stop()
        self._emit(EventKind.WORKERS_STOPPED, reason="excluded")
        if won:
            return coord.decide(policy, cause)
        return coord.await_decision(timeout)

    # -- serving one ------------------------------------------------------------------------
    def hold(self, handler: RendezvousHandler, group: WorkerGroup, stop: Callable[[], bool]) -> bool:
        """Serve a pending exclusion (False when there is none): out for the cooldown, then
        on to the next round under a new node id. Returns early on ``stop()`` (a terminating
        signal: the caller acts on it) or the job's shutdown (its next round says how)."""
        ex, records = self.pending, self._records
        if ex is None:
            return False
        self.pending, self._records = None, None
        self.flagged.clear()
        if records is not None and ex.by == handler.node_id:
            records.write(key(ex.node_id), ex.to_json())  # this node's own verdict, sealed
        if group.running:
            group.stop()
            self._emit(EventKind.WORKERS_STOPPED, reason="excluded")
        log.warning("%s", ex.line())
        self._emit(EventKind.NODE_EXCLUDED, node_id=ex.node_id, reason=ex.reason, detail=ex.detail,
                   cooldown_s=ex.cooldown_s, by=ex.by)
        handler.close(leaving=True)  # the others see it leave now, not after a heartbeat timeout
        cool = Cooldown(time.monotonic(), ex.cooldown_s)
        ended = handler.records.wait("shutdown", cool.left(time.monotonic()), stop=stop)
        if self.window is not None:
            self.window.reset()
        if stop():
            return True
        self.rejoins += 1
        self._base = self._base or ex.node_id
        handler.node_id = rejoin_id(self._base, self.rejoins)
        if ended is None:
            log.warning("node %s: cooldown of %gs over; it rejoins the job as node %s", ex.node_id,
                        ex.cooldown_s, handler.node_id)
        return True


__all__ = ["ExclusionGate"]

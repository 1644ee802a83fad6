"""What ends the watch over a running round, and in which order the causes are taken.

Apart from the loop (``elastic.py``) because it is the one place a reader looks for "why did
the agent stop watching and do something": every wake-up is an event (a worker's exit on its
pidfd, a peer's failure note, a membership change, a failed health check, an exclusion, a
signal, a timer's expiry), and :func:`monitor` names the first that needs the loop as an
:class:`Outcome`. A failed worker under in-place recovery is replaced here and the watch
goes on; a signal that does not stop the agent is forwarded to the workers. The order is the
precedence: this node's failures before a peer's, a peer's before membership news, and the
end (every worker finished) last.
"""
from __future__ import annotations

from typing import Callable

from ..rendezvous import MembershipWatch
from ..store import StoreError
from ..supervisor.env import Assignment
from ..supervisor.group import WorkerGroup
from ..supervisor.spec import WorkerResult
from .coordination import RoundCoordinator
from .excluded import ExclusionGate
from .health import HealthWatch
from .inplace import InPlaceRound
from .outcome import DecisionAction, Outcome
from .recovery import RecoveryWatch
from .signals import Signals
from .watchdog import Watchdog


def monitor(group: WorkerGroup, coord: RoundCoordinator, watch: MembershipWatch, *,
            inplace: InPlaceRound | None, recovery: RecoveryWatch, watchdog: Watchdog | None,
            signals: Signals, health: HealthWatch | None, exclusion: ExclusionGate,
            emit_expiries: Callable[[], None], assignment: Assignment | None,
            on_replaced: Callable[[float], None]) -> tuple[Outcome, list[WorkerResult]]:
    """Block until something needs the loop's attention; all wake-ups are events. Returns the
    outcome and this node's failed workers (empty for any other cause); ``on_replaced`` gets
    the time the failures being replaced in place exited."""
    while True:
        exited = group.wait_any(timeout=recovery.wait(5.0 if inplace is None else inplace.wait_timeout(5.0)))
        recovery.poll()  # a recovery's first step (read from the steps block)
        if watchdog is not None and any(r.failed for r in exited):
            watchdog.blame_stopped([r.pid for r in exited if r.failed])
        emit_expiries()
        failed = [r for r in exited if r.failed]
        if failed and inplace is not None and not coord.failed.is_set():
            assert watchdog is not None
            for r in failed:
                watchdog.forget(r.local_rank)
            on_replaced(min(r.ended_at for r in failed))
            if inplace.on_failures(failed):
                assert assignment is not None
                for r in failed:  # the replacements' timers are watched like the others'
                    watchdog.replace(r.local_rank, group.pids()[r.local_rank], assignment, group.attempt_dir)
                continue  # replaced in place; the other workers keep running
            if inplace.decision is not None and inplace.decision.action == DecisionAction.RESTART:
                return Outcome.INPLACE_FALLBACK, failed
        if failed:
            return Outcome.LOCAL_FAILURE, failed
        if inplace is not None and inplace.poll():
            return Outcome.INPLACE_FALLBACK, []
        sig = signals.received
        if sig is not None:
            if signals.stop:
                return Outcome.SIGNAL, []
            group.signal_all(sig)
            signals.received = None
            continue
        if coord.watch_error is not None:  # logged with its cause: a store we cannot use
            raise StoreError(f"the failure watch stopped: {coord.watch_error!r}")
        if coord.failed.is_set():
            return Outcome.PEER_FAILURE, []
        if health is not None and health.failed is not None:
            return Outcome.UNHEALTHY, []
        if exclusion.flagged.is_set():
            return Outcome.EXCLUDED, []
        if watch.changed.is_set():
            return Outcome.MEMBERSHIP, []
        if not group.running:
            if inplace is not None:
                inplace.settle()
            return Outcome.SUCCEEDED, []

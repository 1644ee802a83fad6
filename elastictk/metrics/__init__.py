"""elastictk.metrics: Prometheus metrics, the JSON-lines event log, and worker progress.

Workers import this package for :func:`step`, :func:`step_timer` and :func:`checkpoint` only;
those are loaded eagerly and import nothing heavy. The agent-side names (which import
prometheus-client) load on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import exports

from .worker import ENV_PATH, StepTimer, checkpoint, enabled, step, step_timer

_LAZY = {
    "AgentMetrics": ".agent_metrics",
    "Event": ".events", "EventLog": ".events", "EventLogError": ".events",
    "event_log_path": ".events", "iter_events": ".events", "read_events": ".events",
    "BoundedLabel": ".labels", "exit_detail": ".labels",
    "MetricsServer": ".server", "MetricsServerError": ".server",
    "StepsBlockError": ".steps", "StepTotals": ".steps", "WorkerStepsBlock": ".steps",
    "goodput": ".steps", "totals": ".steps",
    "Telemetry": ".telemetry", "TelemetryError": ".telemetry",
}

__all__ = sorted([*_LAZY, "ENV_PATH", "StepTimer", "checkpoint", "enabled", "step", "step_timer"])


__getattr__ = exports(__name__, _LAZY)


if TYPE_CHECKING:
    from .agent_metrics import AgentMetrics
    from .events import Event, EventLog, EventLogError, event_log_path, iter_events, read_events
    from .labels import BoundedLabel, exit_detail
    from .server import MetricsServer, MetricsServerError
    from .steps import StepsBlockError, StepTotals, WorkerStepsBlock, goodput, totals
    from .telemetry import Telemetry, TelemetryError

"""``Telemetry``: everything a launcher needs for metrics and events, as one owner.

It bundles the agent's registry, :class:`AgentMetrics`, the :class:`MetricsServer`, the
:class:`WorkerStepsBlock` and the :class:`EventLog`, so a launcher wires them with three
touches: ``on_event=telemetry.on_event`` for the agent, ``env=telemetry.worker_env()`` for
the workers, ``telemetry.close()`` when the agent is done. Metrics exist only when a port
was asked for; events are always recorded (to ``event_log``, else to the run directory).
"""
from __future__ import annotations

import logging
import os
from types import TracebackType
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from .agent_metrics import AgentMetrics
from .events import EventLog, EventLogError
from .kinds import EventKind
from .server import MetricsServer, MetricsServerError
from .steps import StepsBlockError, WorkerStepsBlock

log = logging.getLogger("elastictk.metrics")


class TelemetryError(RuntimeError):
    """Metrics or events could not be set up; one line naming the cause and the fix."""


class LaunchOptions(Protocol):
    """The fields of ``elastictk.cli.LaunchConfig`` that telemetry reads."""

    @property
    def run_id(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def nproc_per_node(self) -> int: ...
    @property
    def max_restarts(self) -> int: ...
    @property
    def metrics_port(self) -> int | None: ...
    @property
    def metrics_host(self) -> str: ...
    @property
    def event_log(self) -> str | None: ...


class Telemetry:
    """Owns the metrics and event sinks of one agent; ``close()`` releases all of them."""

    def __init__(self, *, job: str, role: str = "default", node: str | None = None,
                 local_world_size: int | None = None, max_restarts: int | None = None,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 event_log: str | os.PathLike[str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics: AgentMetrics | None = None
        self.server: MetricsServer | None = None
        self.steps: WorkerStepsBlock | None = None
        self.events: EventLog | None = None
        try:
            self.events = EventLog(event_log, run_id=job)
            if metrics_port is not None:
                if local_world_size:
                    self.steps = WorkerStepsBlock(local_world_size)
                self.metrics = AgentMetrics(self.registry, job=job, node=node, role=role,
                                            max_restarts=max_restarts,
                                            local_world_size=local_world_size, steps=self.steps)
                self.server = MetricsServer(self.registry, metrics_host, metrics_port)
        except (EventLogError, MetricsServerError, StepsBlockError) as e:
            self.close()
            raise TelemetryError(str(e)) from None
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_launch(cls, config: LaunchOptions, *, node: str | None = None) -> "Telemetry":
        """From ``elastictk-run``'s flags (``--metrics-port``, ``--metrics-host``, ``--event-log``)."""
        return cls(job=config.run_id, role=config.role, node=node,
                   local_world_size=config.nproc_per_node, max_restarts=config.max_restarts,
                   metrics_port=config.metrics_port, metrics_host=config.metrics_host,
                   event_log=config.event_log)

    def on_event(self, kind: EventKind, **fields: Any) -> None:
        """The agent's ``on_event`` (an :class:`~elastictk.metrics.kinds.Emit`): records to the
        event log, then the metrics; never raises."""
        if self.events is not None:
            self.events(kind, **fields)
        if self.metrics is not None:
            self.metrics(kind, **fields)

    __call__ = on_event

    def worker_env(self) -> dict[str, str]:
        """Environment for the workers, so ``elastictk.metrics.step()`` reaches this agent."""
        return self.steps.env() if self.steps is not None else {}

    @property
    def metrics_url(self) -> str | None:
        return self.server.url if self.server is not None else None

    def close(self) -> None:
        """Stop serving, free the steps block, close the event log; idempotent."""
        for part in ("server", "steps", "events"):
            obj = getattr(self, part, None)
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    log.warning("could not close the %s", part, exc_info=True)
                setattr(self, part, None)

    def __enter__(self) -> "Telemetry":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

"""``Telemetry``: everything a launcher needs for metrics and events, as one owner.

It bundles the agent's registry, :class:`AgentMetrics`, the :class:`MetricsServer`, the
:class:`WorkerStepsBlock` and the :class:`EventLog`, so a launcher wires them with three
touches: ``on_event=telemetry.on_event`` for the agent, ``env=telemetry.worker_env()`` for
the workers, ``telemetry.close()`` when the agent is done. Metrics exist only when a port
was asked for; events are always recorded (to ``event_log``, else to the run directory).

An exporter ends with its launcher, so without more no scrape would ever see
``elastictk_agent_state{state="failed"}`` and no alert on it could fire: when the job failed,
``close()`` first keeps serving until one scrape has been answered after the failure, or
``metrics_linger`` seconds pass (``--metrics-linger``), saying so in one line; SIGINT or
SIGTERM ends that wait at once.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import threading
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Iterator, Protocol

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
    @property
    def metrics_linger(self) -> float: ...


class Telemetry:
    """Owns the metrics and event sinks of one agent; ``close()`` releases all of them."""

    def __init__(self, *, job: str, role: str = "default", node: str | None = None,
                 local_world_size: int | None = None, max_restarts: int | None = None,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 event_log: str | os.PathLike[str] | None = None, metrics_linger: float = 0.0) -> None:
        if not (isinstance(metrics_linger, (int, float)) and math.isfinite(metrics_linger)
                and metrics_linger >= 0):
            raise TelemetryError(f"metrics linger {metrics_linger!r}: use a finite number of seconds >= 0")
        self.linger_s = float(metrics_linger)
        self._lingered = False
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
                   event_log=config.event_log, metrics_linger=config.metrics_linger)

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

    def linger(self) -> bool | None:
        """When the job failed: serve until a scrape has seen it (True), ``metrics_linger``
        seconds pass or a SIGINT/SIGTERM arrives (False). None when there is nothing to wait
        for (no exporter, no linger, the job did not fail, or this wait was already had)."""
        server, metrics = self.server, self.metrics
        if (server is None or metrics is None or self.linger_s <= 0 or self._lingered
                or metrics.current_state != "failed"):
            return None
        self._lingered = True  # once: close() after a linger() does not wait again
        after = server.requests  # a request read after this one sees the failed state
        log.warning('job failed: serving metrics at %s until one scrape has seen state="failed" '
                    "(at most %gs; Ctrl-C ends the wait; --metrics-linger 0 turns it off)",
                    server.url, self.linger_s)
        try:
            with _signals_end_wait():
                seen = server.wait_for_scrape(after, self.linger_s)
        except _WaitEnded as e:
            log.warning("metrics: stopped waiting for a scrape (%s)", e)
            return False
        if not seen:
            log.warning('metrics: no scrape within %gs: no alert on state="failed" saw this failure',
                        self.linger_s)
        return seen

    def close(self) -> None:
        """Linger if the job failed (see :meth:`linger`), then stop serving, free the steps
        block, close the event log; idempotent."""
        try:
            self.linger()
        except Exception:
            log.warning("could not wait for a scrape of the failed state", exc_info=True)
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


class _WaitEnded(Exception):
    """A SIGINT or SIGTERM arrived while a failed job's exporter waited for a scrape."""


@contextmanager
def _signals_end_wait() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`_WaitEnded` out of the wait (main thread only, where
    Python runs signal handlers); the handlers before are restored on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise _WaitEnded(signal.Signals(signum).name)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)

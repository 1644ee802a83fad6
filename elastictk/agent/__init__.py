"""elastictk.agent: the elastic agent, what a launcher builds on.

One :class:`ElasticAgent` runs per node: it joins rendezvous rounds, starts the node's workers
through a :class:`~elastictk.supervisor.WorkerGroup`, watches them, and restarts (all workers,
or only the failed one in place) within the job-wide budget of a :class:`RestartPolicy`.

Two ways in, both documented in ``docs/launcher-authors.md``:

- ``build_agent(LaunchConfig)``: torchrun's semantics from torchrun's flags (what
  ``elastictk-run`` does), for a launcher with its own front;
- ``ElasticAgent(AgentConfig(...), store)``: every knob, for a launcher with its own semantics.

Names load on first use: ``elastictk-run`` imports :func:`start_preload` before torch is
imported, so the fork server's import of torch overlaps the launcher's own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import exports

_LAZY = {
    "AgentConfig": ".config", "ElasticAgent": ".elastic",
    "AgentResult": ".outcome", "DecisionAction": ".outcome", "Outcome": ".outcome",
    "Recovery": ".outcome", "ResultState": ".outcome",
    "Backoff": ".policy", "MaxRestarts": ".policy", "RestartIntensity": ".policy",
    "RestartPolicy": ".policy",
    "Decision": ".coordination",
    "build_agent": ".launch", "start_preload": ".launch", "worker_start_method": ".launch",
}

__all__ = sorted(_LAZY)


__getattr__ = exports(__name__, _LAZY)


if TYPE_CHECKING:
    from .coordination import Decision
    from .config import AgentConfig
    from .elastic import ElasticAgent
    from .launch import build_agent, start_preload, worker_start_method
    from .outcome import AgentResult, DecisionAction, Outcome, Recovery, ResultState
    from .policy import Backoff, MaxRestarts, RestartIntensity, RestartPolicy

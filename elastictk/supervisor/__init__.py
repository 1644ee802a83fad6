"""elastictk.supervisor

Public names of the worker group are exported lazily: every function worker and fork-server
child imports this package on its way to ``elastictk.supervisor.child``, and should not pay for
importing the agent-side machinery it never uses.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import exports

_LAZY = {
    "Assignment": ".env", "AssignmentError": ".env", "NodeRanks": ".env",
    "assign_ranks": ".env", "worker_env": ".env",
    "DEFAULT_PRELOAD": ".forkserver", "ForkServerError": ".forkserver",
    "PreloadServer": ".forkserver",
    "GroupStateError": ".group", "StartInterrupted": ".group", "WorkerGroup": ".group",
    "LogDirError": ".logs",
    "WorkerStartError": ".process",
    "SpecError": ".spec", "Std": ".spec", "WorkerResult": ".spec", "WorkerSpec": ".spec",
    "parse_python_argv": ".spec", "python_module_argv": ".spec",
    "python_script_argv": ".spec", "signal_name": ".spec",
}

__all__ = sorted(_LAZY)


__getattr__ = exports(__name__, _LAZY)


if TYPE_CHECKING:
    from .env import Assignment, AssignmentError, NodeRanks, assign_ranks, worker_env
    from .forkserver import DEFAULT_PRELOAD, ForkServerError, PreloadServer
    from .group import GroupStateError, StartInterrupted, WorkerGroup
    from .logs import LogDirError
    from .process import WorkerStartError
    from .spec import (
        SpecError, Std, WorkerResult, WorkerSpec, parse_python_argv, python_module_argv,
        python_script_argv, signal_name,
    )

"""elastictk.supervisor

Public names of the worker group are exported lazily: every function worker and fork-server
child imports this package on its way to ``elastictk.supervisor.child``, and should not pay for
importing the agent-side machinery it never uses.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "Assignment": ".env", "AssignmentError": ".env", "NodeRanks": ".env",
    "assign_ranks": ".env", "worker_env": ".env",
    "DEFAULT_PRELOAD": ".forkserver", "ForkServerError": ".forkserver",
    "PreloadServer": ".forkserver",
    "GroupStateError": ".group", "WorkerGroup": ".group",
    "LogDirError": ".logs",
    "WorkerStartError": ".process",
    "SpecError": ".spec", "Std": ".spec", "WorkerResult": ".spec", "WorkerSpec": ".spec",
    "parse_python_argv": ".spec", "python_module_argv": ".spec",
    "python_script_argv": ".spec", "signal_name": ".spec",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .env import Assignment, AssignmentError, NodeRanks, assign_ranks, worker_env
    from .forkserver import DEFAULT_PRELOAD, ForkServerError, PreloadServer
    from .group import GroupStateError, WorkerGroup
    from .logs import LogDirError
    from .process import WorkerStartError
    from .spec import (
        SpecError, Std, WorkerResult, WorkerSpec, parse_python_argv, python_module_argv,
        python_script_argv, signal_name,
    )

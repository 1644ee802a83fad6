"""How a launcher hands a fault plan to its workers: a few environment variables.

- ``ELASTICTK_FAULT_PLAN``: path of the plan JSON. Its step faults fire in the worker whose
  ``RANK`` (or ``GROUP_RANK``, for a node target) and ``TORCHELASTIC_RESTART_COUNT`` match, when
  its training loop calls ``elastictk.faults.checkpoint(step)``.
- ``ELASTICTK_FAULT_AUTO``: ``N`` (>= 1) turns on the automatic mode: every ``N`` calls of
  ``torch.distributed.all_reduce`` count as one step, for scripts that never call
  ``checkpoint`` (see ``auto``).
- ``ELASTICTK_FAULT_LOG``: a file each worker appends one JSON line to just before it injects a
  fault (time, rank, step, attempt, pid, kind), for the chaos report.
- ``ELASTICTK_FAULT_HANG_LIMIT``: seconds an injected hang inside a collective waits for a
  watchdog before the worker gives up and exits (default 3600), so a job run without a watchdog
  still ends.

Workers forked by the agent call :func:`activate_from_env` once they are workers (their
environment in place); ``subprocess`` workers get :data:`SITE_DIR` on ``PYTHONPATH`` from
:func:`worker_env`, whose ``sitecustomize`` calls it at interpreter start. Without
``ELASTICTK_FAULT_AUTO`` there is nothing to activate: ``checkpoint`` reads the plan itself on
its first call.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping, Optional, Union

ENV_PLAN = "ELASTICTK_FAULT_PLAN"
ENV_AUTO = "ELASTICTK_FAULT_AUTO"
ENV_LOG = "ELASTICTK_FAULT_LOG"
ENV_HANG_LIMIT = "ELASTICTK_FAULT_HANG_LIMIT"
DEFAULT_HANG_LIMIT_S = 3600.0
SITE_DIR = str(Path(__file__).resolve().parent / "_site")


def worker_env(plan_path: Union[str, os.PathLike[str]], *, auto: int = 0,
               log_path: Union[str, os.PathLike[str], None] = None,
               hang_limit_s: Optional[float] = None,
               base_env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The variables to add to every worker's environment for ``plan_path``.

    ``auto`` > 0 turns on the automatic mode (``auto`` all_reduce calls per step) and puts
    :data:`SITE_DIR` first on ``PYTHONPATH``, keeping ``base_env``'s entries after it (pass the
    environment the worker would otherwise get, including other launcher additions such as the
    timer's, so neither hides the other).
    """
    if isinstance(auto, bool) or not isinstance(auto, int) or auto < 0:
        raise ValueError(f"auto {auto!r} must be an integer >= 0 (all_reduce calls per step; "
                         "0 = off)")
    env = {ENV_PLAN: str(Path(plan_path).resolve())}
    if log_path is not None:
        env[ENV_LOG] = str(Path(log_path).resolve())
    if hang_limit_s is not None:
        if not 0 < hang_limit_s <= 1e9:
            raise ValueError(f"hang limit {hang_limit_s!r} must be > 0 seconds")
        env[ENV_HANG_LIMIT] = repr(float(hang_limit_s))
    if auto:
        env[ENV_AUTO] = str(auto)
        base = os.environ if base_env is None else base_env
        rest = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_DIR]
        env["PYTHONPATH"] = os.pathsep.join([SITE_DIR, *rest])
    return env


def activate_from_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Install the automatic injector if the launcher asked for it; True if faults are armed.

    A malformed value is reported in one line on stderr and ignored: the training must still
    start (the chaos run then sees the faults that never came).
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_AUTO)
    if not raw or not env.get(ENV_PLAN):
        return False
    try:
        per_step = int(raw)
        if per_step < 1:
            raise ValueError
    except ValueError:
        print(f"elastictk.faults: ignoring {ENV_AUTO}={raw!r}: it must be an integer >= 1 "
              "(all_reduce calls per step)", file=sys.stderr)
        return False
    from .auto import install_auto

    return install_auto(calls_per_step=per_step)


def hang_limit(environ: Optional[Mapping[str, str]] = None) -> float:
    env = os.environ if environ is None else environ
    raw = env.get(ENV_HANG_LIMIT)
    try:
        value = float(raw) if raw else DEFAULT_HANG_LIMIT_S
    except ValueError:
        value = DEFAULT_HANG_LIMIT_S
    return value if 0 < value <= 1e9 else DEFAULT_HANG_LIMIT_S

"""Turning timers on inside a worker before the user's code runs, without touching the script.

Two ways in, one function: :func:`activate_from_env` reads ``ELASTICTK_COLLECTIVE_TIMEOUT`` and,
when set, calls ``watch_collectives`` (which only installs an import hook if torch is not
loaded yet, so it costs microseconds). With the variable unset it does nothing at all.

- Workers forked by the agent (function workers, the preload fork server's children) call it
  right after they become a worker (environment in place, before the user's code).
- ``subprocess`` workers start a fresh interpreter, so the agent puts :data:`SITE_DIR` first on
  their ``PYTHONPATH``. Its ``sitecustomize.py`` steps aside (removes itself from ``sys.path``
  and imports the ``sitecustomize`` it shadowed, so a user's or a distribution's one still runs)
  and calls :func:`activate_from_env`. Only Python workers notice it; a binary ignores it.

The region itself (``ELASTICTK_TIMER_REGIONS``) needs no activation: it is attached on the first
timer, so a script that never uses one never maps it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping, Optional

from . import layout as L

SITE_DIR = str(Path(__file__).resolve().parent / "_site")
ENV_HOOKS = "ELASTICTK_WORKER_HOOKS"  # worker hooks the site dir activates too (see _site)


def activate_from_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Enable what the launcher asked for in the environment; True if anything was enabled.

    A malformed value is reported in one line on stderr and ignored: a watchdog setting must
    never stop the training it watches from starting.
    """
    env = os.environ if environ is None else environ
    raw = env.get(L.ENV_COLLECTIVE_TIMEOUT)
    if not raw:
        return False
    from .client import TimerError
    from .collectives import watch_collectives

    try:
        watch_collectives(float(raw))
    except (ValueError, TimerError):
        print(f"elastictk.timer: ignoring {L.ENV_COLLECTIVE_TIMEOUT}={raw!r}: it must be a "
              "number of seconds > 0", file=sys.stderr)
        return False
    return True


def worker_env(regions: str, *, collective_timeout: Optional[float] = None,
               base_env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The variables a worker needs for timers in the agent's region file ``regions``.

    ``base_env`` is the environment the worker would otherwise get (default: this process's),
    used to keep an existing ``PYTHONPATH`` after :data:`SITE_DIR`. :data:`SITE_DIR` goes on
    ``PYTHONPATH`` for a collective timeout and also when ``base_env`` names worker hooks
    (``ELASTICTK_WORKER_HOOKS``: the metrics' optimizer-step count), so fresh-interpreter
    workers activate them as forked ones do.
    """
    env = {L.ENV_REGIONS: regions}
    base = os.environ if base_env is None else base_env
    if collective_timeout is not None:
        if not 0 < collective_timeout <= 1e9:
            raise ValueError(f"collective timeout {collective_timeout!r} must be > 0 seconds; "
                             "pass e.g. --collective-timeout 300")
        env[L.ENV_COLLECTIVE_TIMEOUT] = repr(float(collective_timeout))
    if collective_timeout is not None or base.get(ENV_HOOKS, "").strip():
        rest = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_DIR]
        env["PYTHONPATH"] = os.pathsep.join([SITE_DIR, *rest])
    return env

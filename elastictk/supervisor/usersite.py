"""A user's ``sitecustomize`` in workers forked from the preload server.

A fresh interpreter runs the first ``sitecustomize`` on its path at start (under torchrun, every
worker does). A worker forked from elastictk's preload server starts no interpreter, so the
server's run of it, once, with the agent's environment, is all it would get: a hook that reads
``RANK``, sets a per-process state or writes a marker would silently not run in the workers.
:func:`rerun_sitecustomize` runs it again in the worker, after its environment is in place and
before the script, as a fresh interpreter would.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

_OWN_SITE = os.path.realpath(os.path.join(os.path.dirname(os.path.dirname(__file__)), "timer", "_site"))


def user_sitecustomize(path: list[str]) -> str | None:
    """The file of the first ``sitecustomize`` on ``path`` that is not elastictk's own (the
    timer's, which steps aside for the user's anyway), or None."""
    dirs = [p for p in path if os.path.realpath(p or os.curdir) != _OWN_SITE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", dirs)
    return None if spec is None or not spec.origin or spec.origin in ("built-in", "frozen") else spec.origin


def rerun_sitecustomize() -> bool:
    """Run the user's ``sitecustomize`` in this (forked) worker; True if one ran.

    An exception in it is printed as ``site.py`` prints it, and the worker goes on.
    """
    origin = user_sitecustomize(sys.path)
    if origin is None:
        return False
    spec = importlib.util.spec_from_file_location("sitecustomize", origin)
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - what site.py does with a failing sitecustomize
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(e).__name__}: {e}",
              file=sys.stderr)
    return True

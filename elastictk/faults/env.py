"""How a launcher hands a fault plan to its workers: a few environment variables.

- ``ELASTICTK_FAULT_PLAN``: path of the plan JSON. Its step faults fire in the worker whose
  ``RANK`` (or ``GROUP_RANK``, for a node target) and ``TORCHELASTIC_RESTART_COUNT`` match, when
  its training loop calls ``elastictk.faults.fault_point(step)``.
- ``ELASTICTK_FAULT_AUTO``: the automatic step count, for scripts that never call
  ``checkpoint`` (see ``auto``): ``optimizer`` (every ``optimizer.step()`` is a step; what
  ``elastictk-chaos`` sets) or ``N`` >= 1 (every ``N`` calls of ``torch.distributed.all_reduce``).
- ``ELASTICTK_WORKER_HOOKS``: comma-separated ``elastictk.*`` modules each worker activates at
  start (``activate_from_env()``) and ``run_elastic`` tells of each step (``on_loop_step``):
  here ``elastictk.faults.auto``. Read by ``elastictk/supervisor/child.py`` in forked workers,
  by a ``sitecustomize.py`` in subprocess workers (:func:`worker_env` puts the private
  directory :func:`private_site` wrote :data:`SITECUSTOMIZE` into first on their
  ``PYTHONPATH``) and by ``elastictk/inplace/loop.py``; the metrics' steps block adds
  ``elastictk.metrics.worker`` the same way.
- ``ELASTICTK_FAULT_LOG``: a file each worker appends one JSON line to just before it injects a
  fault (time, rank, step, attempt, pid, kind), for the chaos report.
- ``ELASTICTK_FAULT_HANG_LIMIT``: seconds an injected hang inside a collective waits for a
  watchdog before the worker gives up and exits (default 3600), so a job run without a watchdog
  still ends.

Without ``ELASTICTK_FAULT_AUTO`` there is nothing to activate: ``checkpoint`` reads the plan
itself on its first call.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Optional

ENV_PLAN = "ELASTICTK_FAULT_PLAN"
ENV_AUTO = "ELASTICTK_FAULT_AUTO"
ENV_LOG = "ELASTICTK_FAULT_LOG"
ENV_HANG_LIMIT = "ELASTICTK_FAULT_HANG_LIMIT"
ENV_HOOKS = "ELASTICTK_WORKER_HOOKS"
HOOK = "elastictk.faults.auto"
AUTO_OPTIMIZER = "optimizer"
DEFAULT_HANG_LIMIT_S = 3600.0
SITE_PREFIX = "elastictk-site-"  # the private temporary directory that holds SITECUSTOMIZE

#: The interpreter-start hook of subprocess workers (a fresh interpreter runs no code of the
#: launcher's): step aside for the sitecustomize it shadows (the timer's, a user's, a
#: distribution's), then, in a worker only (the agent and its fork server inherit PYTHONPATH
#: too), activate every module named in ELASTICTK_WORKER_HOOKS, as
#: elastictk/supervisor/child.py does in forked workers. Failure-proof: nothing here may stop
#: the worker from starting.
SITECUSTOMIZE = '''"""elastictk's worker hooks for subprocess workers (written by elastictk.faults.env)."""
import importlib
import os
import sys


def _elastictk_hooks():
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if not p or os.path.realpath(p) != here]
    me = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401  (the one this file shadows, if any)
    except ModuleNotFoundError as e:
        if e.name != "sitecustomize":
            print(f"Error in sitecustomize: {e!r}", file=sys.stderr)
        if me is not None:
            sys.modules["sitecustomize"] = me
    except Exception as e:  # what site.py itself would do
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\\n{type(e).__name__}: {e}",
              file=sys.stderr)
    if "RANK" not in os.environ or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return
    for name in os.environ.get("ELASTICTK_WORKER_HOOKS", "").split(","):
        if name.strip().startswith("elastictk."):
            try:
                importlib.import_module(name.strip()).activate_from_env()
            except Exception as e:
                print(f"elastictk: worker hook {name} is off: {e!r}", file=sys.stderr)


_elastictk_hooks()
del _elastictk_hooks
'''


def add_hook(current: Optional[str], module: str) -> str:
    """``ELASTICTK_WORKER_HOOKS`` with ``module`` added once (order kept)."""
    names = [n for n in (current or "").split(",") if n.strip()]
    return ",".join(names if module in names else [*names, module])


def worker_env(plan_path: str | os.PathLike[str], *, auto: int | str = 0,
               log_path: str | os.PathLike[str] | None = None,
               hang_limit_s: Optional[float] = None,
               base_env: Optional[Mapping[str, str]] = None,
               site: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The variables to add to every worker's environment for ``plan_path``.

    ``auto`` turns on the automatic step count: ``"optimizer"`` (optimizer steps) or an integer
    > 0 (all_reduce calls per step); it names :data:`HOOK` in ``ELASTICTK_WORKER_HOOKS`` and puts
    ``site`` (the directory :func:`private_site` yields, which must be given) first on
    ``PYTHONPATH``, keeping ``base_env``'s entries after it (pass the environment the worker
    would otherwise get, including other launcher additions such as the timer's, so neither
    hides the other).
    """
    if auto != AUTO_OPTIMIZER and (isinstance(auto, bool) or not isinstance(auto, int)
                                   or auto < 0):
        raise ValueError(f"auto {auto!r} must be {AUTO_OPTIMIZER!r} or an integer >= 0 "
                         "(all_reduce calls per step; 0 = off)")
    env = {ENV_PLAN: str(Path(plan_path).resolve())}
    if log_path is not None:
        env[ENV_LOG] = str(Path(log_path).resolve())
    if hang_limit_s is not None:
        if not 0 < hang_limit_s <= 1e9:
            raise ValueError(f"hang limit {hang_limit_s!r} must be > 0 seconds")
        env[ENV_HANG_LIMIT] = repr(float(hang_limit_s))
    if auto:
        if site is None:
            raise ValueError("auto steps need site=: the private directory of the workers' "
                             "sitecustomize.py, from `with private_site() as site:`")
        env[ENV_AUTO] = str(auto)
        base = os.environ if base_env is None else base_env
        env[ENV_HOOKS] = add_hook(base.get(ENV_HOOKS), HOOK)
        rest = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(site)]
        env["PYTHONPATH"] = os.pathsep.join([str(site), *rest])
    return env


def site_dir() -> str:
    """A new directory holding the subprocess workers' ``sitecustomize.py``: code every worker
    runs at start, so it lives nowhere another user could have made or written first
    (``tempfile.mkdtemp``: this user's, mode 0700, an unpredictable name), never in a report
    or plan directory. The caller removes it (:func:`private_site` does)."""
    d = tempfile.mkdtemp(prefix=SITE_PREFIX)
    try:
        fd = os.open(os.path.join(d, "sitecustomize.py"),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(SITECUSTOMIZE)
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    return d


@contextmanager
def private_site() -> Iterator[str]:
    """:func:`site_dir` for the length of a job, removed at the end (also when the job fails)."""
    d = site_dir()
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def hang_limit(environ: Optional[Mapping[str, str]] = None) -> float:
    env = os.environ if environ is None else environ
    raw = env.get(ENV_HANG_LIMIT)
    try:
        value = float(raw) if raw else DEFAULT_HANG_LIMIT_S
    except ValueError:
        value = DEFAULT_HANG_LIMIT_S
    return value if 0 < value <= 1e9 else DEFAULT_HANG_LIMIT_S

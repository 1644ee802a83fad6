"""The automatic in-worker step count: step faults for scripts that never call ``checkpoint``.

Two ways of counting, chosen by ``ELASTICTK_FAULT_AUTO`` (see ``env``):

- ``optimizer`` (what ``elastictk-chaos`` sets): every ``optimizer.step()`` of the worker is a
  step, seen through torch's global optimizer step hook
  (``torch.optim.optimizer.register_optimizer_step_post_hook``). That covers any training loop,
  DDP included (its gradient all_reduces run in C++, but the optimizer step is Python). The
  hook is registered the moment ``torch.optim`` finishes loading (an import hook, so a worker
  that never imports torch never does); the steps of one optimizer count (the first one that
  steps in the process; another takes over once it is freed), so a loop with two optimizers is
  not counted twice.
- ``N`` (an integer >= 1): every ``N`` calls of ``torch.distributed.all_reduce`` from Python
  start a step (for loops without an optimizer; DDP's buckets are not seen).

The count is in the job's own step numbers: the step ``State.restore()`` brought back (read
at the first optimizer step, from ``elastictk.data.record``; 0 when it restored nothing) plus
the optimizer steps run since, so a job resumed from a snapshot reaches a planned step where a
job run from the start would. A process that never calls ``restore()`` counts from 0 (a
script that keeps its own ``torch.save`` checkpoints: the runtime cannot know where it
resumed). After step ``n`` the faults planned at step ``<= n`` fire. Scripts that know their step take over:
``elastictk.faults.fault_point(step)`` and ``run_elastic``'s own step report outrank this count
(see ``inworker``).

Activation: a launcher names this module in ``ELASTICTK_WORKER_HOOKS``; every worker calls
:func:`activate_from_env` at start (forked workers in ``elastictk/supervisor/child.py``,
subprocess workers from the ``sitecustomize.py`` ``env.worker_env`` writes), and ``run_elastic`` calls
:func:`on_loop_step` for each step it runs.
"""
from __future__ import annotations

import os
import sys
import threading
import weakref
from types import ModuleType
from typing import Any, Mapping, Optional

from . import inworker
from .collective import ensure_wrapped
from .env import AUTO_OPTIMIZER, ENV_AUTO, ENV_PLAN
from .plan import FaultPlan
from .._onimport import OnImport, now_or_on_import

OPTIM = "torch.optim.optimizer"

_lock = threading.Lock()
_calls_per_step = 0  # 0: not counting all_reduce calls
_calls = 0
_optimizer_steps = 0
_counting_optimizer = False
_owner: Optional[weakref.ref[Any]] = None  # the optimizer whose steps count
_handle: Any = None
_optim_hook: Optional[OnImport] = None


def install_auto(plan: FaultPlan | str | os.PathLike[str] | None = None, *,
                 calls_per_step: int = 1, rank: Optional[int] = None, node: Optional[int] = None,
                 attempt: Optional[int] = None) -> bool:
    """Count all_reduce calls as steps and fire this worker's step faults from them.

    ``plan`` defaults to ``ELASTICTK_FAULT_PLAN``; ``rank``/``node``/``attempt`` default to the
    torchrun environment. Returns True if this worker has faults armed (and all_reduce is
    wrapped, now or as soon as torch.distributed is imported).
    """
    global _calls_per_step, _calls
    if isinstance(calls_per_step, bool) or not isinstance(calls_per_step, int) or \
            calls_per_step < 1:
        raise ValueError(f"calls_per_step {calls_per_step!r} must be an integer >= 1")
    if not _arm(plan, rank, node, attempt):
        return False
    with _lock:
        _calls_per_step, _calls = calls_per_step, 0
    ensure_wrapped(on_step=_count)
    return True


def install_optimizer(plan: FaultPlan | str | os.PathLike[str] | None = None, *,
                      rank: Optional[int] = None, node: Optional[int] = None,
                      attempt: Optional[int] = None) -> bool:
    """Count ``optimizer.step()`` calls as steps (see the module's docstring). Returns True if
    this worker has faults armed; the hook is registered either way, so an in-place job whose
    later generation arms faults here (``on_loop_step``) is counted from the start."""
    global _counting_optimizer, _optimizer_steps, _optim_hook
    armed = _arm(plan, rank, node, attempt)
    with _lock:
        _counting_optimizer, _optimizer_steps = True, 0
        _optim_hook = now_or_on_import(OPTIM, "register_optimizer_step_post_hook", _registered_on_import,
                                       _lock, _optim_hook)
    return bool(armed)


def _arm(plan: FaultPlan | str | os.PathLike[str] | None, rank: Optional[int],
         node: Optional[int], attempt: Optional[int]) -> int:
    if plan is None:
        return inworker.load_from_env()
    if not isinstance(plan, FaultPlan):
        plan = FaultPlan.load(plan)
    env_rank = int(os.environ.get("RANK", "0") or 0)
    env_node = os.environ.get("GROUP_RANK")
    return inworker.arm(
        plan, rank=env_rank if rank is None else rank,
        node=(int(env_node) if env_node else None) if node is None else node,
        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if attempt is None else attempt)


def _registered_on_import(module: ModuleType) -> None:
    global _optim_hook
    _optim_hook = None
    if _counting_optimizer:
        _register(module)


def _register(module: ModuleType) -> None:
    global _handle
    if _handle is None:
        _handle = module.register_optimizer_step_post_hook(_optimizer_stepped)


def _optimizer_stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
    """torch's global post hook: one finished ``optimizer.step()``."""
    global _owner, _optimizer_steps
    if not _counting_optimizer:
        return
    owner = _owner() if _owner is not None else None
    if owner is None:
        try:
            _owner = weakref.ref(optimizer)
        except TypeError:  # an optimizer without weakref support: count it anyway
            _owner = None
        owner = optimizer
    if owner is not optimizer:
        return  # a second optimizer of the same loop: its steps are the same steps
    if _optimizer_steps == 0:
        _optimizer_steps = _resumed_step()
    _optimizer_steps += 1
    inworker.auto_step(_optimizer_steps)


def _resumed_step() -> int:
    """Where the job's numbering stands at this process's first optimizer step: the step
    ``State.restore()`` brought back, else 0 (imported here: torch is loaded by now)."""
    from ..data import record

    return record.resumed_at() or 0


def optimizer_steps() -> int:
    """``optimizer.step()`` calls counted in this process (0 when not counting)."""
    return _optimizer_steps


def _count() -> None:
    """One all_reduce call: every ``calls_per_step``-th starts a step."""
    global _calls
    per_step = _calls_per_step
    if per_step:
        n = _calls
        _calls = n + 1
        if n % per_step == 0:
            inworker.auto_step(n // per_step)


def stop_counting() -> None:
    """Stop counting steps (tests, mostly; see ``collective.uninstall``)."""
    global _calls_per_step, _counting_optimizer, _handle, _optim_hook, _owner
    with _lock:
        _calls_per_step, _counting_optimizer, _owner = 0, False, None
        if _handle is not None:
            _handle.remove()
            _handle = None
        if _optim_hook is not None:
            _optim_hook.cancel()
            _optim_hook = None


def activate_from_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Install the automatic step count the launcher asked for; True if faults are armed.

    A malformed value is reported in one line on stderr and ignored: the training must still
    start (the chaos run then reports the faults that never came, and why).
    """
    env = os.environ if environ is None else environ
    raw = (env.get(ENV_AUTO) or "").strip()
    if not raw or not env.get(ENV_PLAN):
        return False
    if raw == AUTO_OPTIMIZER:
        return install_optimizer()
    try:
        per_step = int(raw)
        if per_step < 1:
            raise ValueError
    except ValueError:
        print(f"elastictk.faults: ignoring {ENV_AUTO}={raw!r}: it must be {AUTO_OPTIMIZER!r} "
              "or an integer >= 1 (all_reduce calls per step)", file=sys.stderr)
        return False
    return install_auto(calls_per_step=per_step)


def on_loop_step(step: int, *, rank: int, restart_count: int, finished: bool) -> None:
    """``run_elastic``'s report: step ``step`` is about to run (``finished=False``) or has run
    in the generation whose job-wide restart count is ``restart_count``, as ``rank``."""
    if not finished:
        inworker.loop_step(step, rank=rank, attempt=restart_count)

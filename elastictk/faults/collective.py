"""The all_reduce wrapper the in-worker injector needs, and the collective hang.

The hang inside a collective (``hang-in-collective``). A real hang in a collective is one rank
that never arrives while its peers sit inside the all_reduce, waiting for it. That is what is
produced: the faulty worker enters the wrapped ``all_reduce`` and blocks there, before its
contribution is sent, so the peers' real all_reduce (gloo/NCCL) blocks waiting for it; stack
dumps of both show ``all_reduce``. The blocked worker holds a watchdog timer named
``all_reduce`` when the collective timeout is on, so the agent's timer reaper catches it like
a real hung collective. With no watchdog at all it gives up after ``ELASTICTK_FAULT_HANG_LIMIT``
seconds (exit code :data:`HANG_UNCAUGHT_EXIT` and one line saying so), so nothing hangs forever.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Optional

from .._onimport import OnImport, now_or_on_import
from .env import hang_limit

C10D = "torch.distributed.distributed_c10d"
OP = "all_reduce"
HANG_UNCAUGHT_EXIT = 124
_INNER = "__elastictk_fault_inner__"

Hook = Callable[[], None]

_lock = threading.Lock()
_hook: Optional[OnImport] = None
# What the wrapper runs before the real all_reduce, in this order: the step count (auto mode,
# which may fire this step's faults and so arm a hang), then the hang check.
_on_step: Optional[Hook] = None
_on_hang: Optional[Hook] = None


def ensure_wrapped(*, on_step: Optional[Hook] = None, on_hang: Optional[Hook] = None) -> None:
    """Wrap ``all_reduce`` now if torch.distributed is loaded, else right after it loads; the
    hooks given replace the ones before (the injector passes them, this module knows no plan)."""
    global _hook, _on_step, _on_hang
    with _lock:
        if on_step is not None:
            _on_step = on_step
        if on_hang is not None:
            _on_hang = on_hang
        _hook = now_or_on_import(C10D, OP, _on_import, _lock, _hook)


def uninstall() -> None:
    """Put the original ``all_reduce`` back and drop the hooks (tests, mostly)."""
    global _hook, _on_step, _on_hang
    with _lock:
        _on_step = _on_hang = None
        if _hook is not None:
            _hook.cancel()
            _hook = None
        module = sys.modules.get(C10D)
        if module is None:
            return
        for ns in _namespaces(module):
            fn = getattr(ns, OP, None)
            inner = getattr(fn, _INNER, None)
            if inner is not None:  # not a collective timer that was turned off meanwhile
                setattr(ns, OP, _current(inner))


def _namespaces(c10d: ModuleType) -> list[ModuleType]:
    dist = sys.modules.get("torch.distributed")
    return [c10d] + ([dist] if dist is not None and dist is not c10d else [])


def _patch(c10d: ModuleType) -> None:
    current = getattr(c10d, OP)
    if getattr(current, _INNER, None) is not None:
        return  # already ours
    wrapped = _wrap(current)
    for ns in _namespaces(c10d):
        if getattr(ns, OP, None) is current:
            setattr(ns, OP, wrapped)


_UNTIMED = "__elastictk_untimed__"  # what the collective timers' wrapper calls (timer.collectives)


def _wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    # updated=(): not the wrapped function's attributes. Copied from the collective timers'
    # wrapper, their "untimed original" mark would let ``unwatch_collectives`` (run_elastic
    # calls it) take this wrapper for theirs and put the bare all_reduce back: the fault
    # would fire and block nothing.
    @functools.wraps(fn, updated=())
    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        on_step, on_hang = _on_step, _on_hang
        if on_step is not None:
            on_step()
        if on_hang is not None:
            on_hang()
        return _current(fn)(*args, **kwargs)

    setattr(all_reduce, _INNER, fn)
    return all_reduce


def _current(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, or the untimed all_reduce inside it once the collective timers it was wrapped
    around are off (``run_elastic`` turns them off after this wrapper went on top)."""
    try:
        from elastictk.timer import collectives
    except ImportError:  # pragma: no cover - elastictk without its timer layer
        return fn
    while collectives.watching() is None and callable(getattr(fn, _UNTIMED, None)):
        fn = getattr(fn, _UNTIMED)
    return fn


def _timeout() -> Optional[float]:
    """The collective timeout in force: the timers', else (``run_elastic``, whose process group
    times out instead) the launcher's ``--collective-timeout`` from the environment."""
    from elastictk.timer import ENV_COLLECTIVE_TIMEOUT, collectives

    timeout = collectives.watching()
    if timeout is None:
        try:
            timeout = float(os.environ.get(ENV_COLLECTIVE_TIMEOUT, ""))
        except ValueError:
            return None
    return timeout if timeout is not None and 0 < timeout < float("inf") else None


def block_in_collective(op: str) -> None:
    """Block as a rank that never arrives in ``op``: under a watchdog timer named ``op`` when
    the job has a collective timeout, and for at most the hang limit, then exit.

    Under ``run_elastic`` the collective timers are off (the process group times out and the
    survivors re-form in place), yet this rank, which never reaches the backend, would never
    time out: the same timeout is armed here, so the agent's reaper catches it (a
    ``timer_expired`` naming its rank) and its death is recovered in place."""
    limit = hang_limit()
    timer: Any = contextlib.nullcontext()
    try:
        from elastictk.timer import client

        timeout = _timeout()
        if timeout is not None:
            timer = client.expires(after=timeout, scope=op)
    except ImportError:  # pragma: no cover - elastictk without its timer layer
        pass
    from ..timer.marksink import not_in_collective

    not_in_collective()  # as a rank that never arrived looks to the hang judge (metrics/marks.py)
    with timer:
        threading.Event().wait(limit)  # nothing sets it: only a watchdog or the limit ends this
    os.write(2, (f"elastictk.faults: the injected hang in {op} was not caught by any watchdog "
                 f"within {limit:g}s; exiting with code {HANG_UNCAUGHT_EXIT} (run the job with "
                 "a collective timeout, e.g. --collective-timeout 60)\n").encode())
    os._exit(HANG_UNCAUGHT_EXIT)


def _on_import(module: ModuleType) -> None:
    """Wrap all_reduce: now, or the moment ``distributed_c10d`` has run (before
    ``torch.distributed`` re-exports its names). After :func:`uninstall` the wrapper calls no
    hook: it just passes the call on."""
    global _hook
    _hook = None
    _patch(module)

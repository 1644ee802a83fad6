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
import importlib.abc
import importlib.machinery
import os
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Optional

from .env import hang_limit

C10D = "torch.distributed.distributed_c10d"
OP = "all_reduce"
HANG_UNCAUGHT_EXIT = 124
_INNER = "__elastictk_fault_inner__"

Hook = Callable[[], None]

_lock = threading.Lock()
_hook: Optional["_PatchOnImport"] = None
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
        module = sys.modules.get(C10D)
        if module is not None and hasattr(module, OP):
            _patch(module)
        elif _hook is None:
            _hook = _PatchOnImport()
            sys.meta_path.insert(0, _hook)


def uninstall() -> None:
    """Put the original ``all_reduce`` back and drop the hooks (tests, mostly)."""
    global _hook, _on_step, _on_hang
    with _lock:
        _on_step = _on_hang = None
        if _hook is not None:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(_hook)
            _hook = None
        module = sys.modules.get(C10D)
        if module is None:
            return
        for ns in _namespaces(module):
            fn = getattr(ns, OP, None)
            inner = getattr(fn, _INNER, None)
            if inner is not None:
                setattr(ns, OP, inner)


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


def _wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        on_step, on_hang = _on_step, _on_hang
        if on_step is not None:
            on_step()
        if on_hang is not None:
            on_hang()
        return fn(*args, **kwargs)

    setattr(all_reduce, _INNER, fn)
    return all_reduce


def block_in_collective(op: str) -> None:
    """Block as a rank that never arrives in ``op``: under a watchdog timer named ``op`` when
    collective timeouts are on, and for at most the hang limit, then exit."""
    limit = hang_limit()
    timer: Any = contextlib.nullcontext()
    try:
        from elastictk.timer import client, collectives

        timeout = collectives.watching()
        if timeout is not None:
            timer = client.expires(after=timeout, scope=op)
    except ImportError:  # pragma: no cover - elastictk without its timer layer
        pass
    with timer:
        threading.Event().wait(limit)  # nothing sets it: only a watchdog or the limit ends this
    os.write(2, (f"elastictk.faults: the injected hang in {op} was not caught by any watchdog "
                 f"within {limit:g}s; exiting with code {HANG_UNCAUGHT_EXIT} (run the job with "
                 "a collective timeout, e.g. --collective-timeout 60)\n").encode())
    os._exit(HANG_UNCAUGHT_EXIT)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``distributed_c10d`` with the other finders, then wraps all_reduce right after the
    module runs (before ``torch.distributed`` re-exports it). Re-entry is refused, so another
    finder that consults the whole meta path (elastictk's collective timer does) cannot loop."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != C10D or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None and spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, self)
                    return spec
            return None
        finally:
            self._busy.on = False


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, hook: _PatchOnImport) -> None:
        self._inner, self._hook = inner, hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        global _hook
        self._inner.exec_module(module)
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        with _lock:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(self._hook)
            if _hook is self._hook:
                _hook = None
                _patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code ... for inspect/linecache
        return getattr(self._inner, name)

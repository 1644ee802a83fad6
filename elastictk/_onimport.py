"""Run a callback right after a module is imported, without importing it first.

Worker-side hooks (the fault injector's and the metrics' optimizer-step counters) attach to
``torch.optim.optimizer`` only in a worker that imports it: a worker that never touches torch
must not pay for importing it. :class:`OnImport` sits first on ``sys.meta_path``, lets the
other finders find the module, wraps its loader, and once the module has run calls ``then``
(under the owner's lock) and leaves the meta path. Re-entry is refused, so another finder that
consults the whole meta path (elastictk's collective timer does) cannot loop.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any, Callable, ContextManager, Optional


def now_or_on_import(name: str, ready: str, then: Callable[[ModuleType], None],
                     lock: ContextManager[Any], pending: Optional["OnImport"]) -> Optional["OnImport"]:
    """Run ``then(module)`` now if ``name`` is loaded (it has attribute ``ready``), else make
    sure an :class:`OnImport` runs it once it loads. The caller holds ``lock`` and keeps the
    returned hook (its ``pending``, or a new one; None once applied) to :meth:`OnImport.cancel`
    it; ``then`` should forget the hook when it runs."""
    module = sys.modules.get(name)
    if module is not None and hasattr(module, ready):
        then(module)
        return None
    if pending is None:
        pending = OnImport(name, then, lock)
        sys.meta_path.insert(0, pending)
    return pending


class OnImport(importlib.abc.MetaPathFinder):
    """Finds ``name`` with the other finders and runs ``then(module)`` once it has loaded."""

    def __init__(self, name: str, then: Callable[[ModuleType], None],
                 lock: ContextManager[Any]) -> None:
        self.name, self.then, self.lock = name, then, lock
        self._busy = threading.local()

    def cancel(self) -> None:
        """Leave the meta path without running ``then`` (a no-op once it ran)."""
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None and spec.loader is not None:
                    spec.loader = _Loader(spec.loader, self)
                    return spec
            return None
        finally:
            self._busy.on = False


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, hook: OnImport) -> None:
        self._inner, self._hook = inner, hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        with self._hook.lock:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(self._hook)
            self._hook.then(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code ... for inspect/linecache
        return getattr(self._inner, name)

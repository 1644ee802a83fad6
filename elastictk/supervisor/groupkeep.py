"""A process group destroyed under a live DDP model stays referenced until the model is gone, so
freeing the model never frees the group while holding the GIL.

torch 2.13 stashes a Python object (the ``contextvars`` snapshot) in the thread-local state
during every ``backward()``, and every collective issued inside it (DDP's gradient all-reduces)
captures that state. The DDP tutorial's order — ``destroy_process_group()`` at the end of the
training function, the model freed when the function returns — leaves DDP's reducer holding the
last reference to the group. Freeing it there joins gloo's worker threads *with the GIL held*
(the reducer's binding does not release it), while a worker thread may still be freeing a
finished barrier that carries those collectives, which needs the GIL to drop the Python object:
the rank hangs at exit after its last step. Seen here in 4 of 81 runs of a 3-rank DDP job forked
from the preload server (0 of 105 under torchrun's fresh interpreters: the window is timing).

A group destroyed while a live DDP model still uses it is held here, so the reducer never
holds the last reference; it is let go at the next ``init_process_group`` or
``destroy_process_group`` once every such model is gone, when gloo's threads are long idle (a
forked worker ends with ``os._exit`` and needs no release at all). A group no DDP model uses is
never held: its sockets close at ``destroy_process_group`` as always, which peers blocked in a
collective with this rank rely on to notice (in-place recovery does).
"""
from __future__ import annotations

import functools
import sys
import threading
import weakref
from types import ModuleType
from typing import Any, Optional

from .._onimport import OnImport, now_or_on_import

C10D = "torch.distributed.distributed_c10d"
DDP = "torch.nn.parallel.distributed"
_MARK = "__elastictk_keeps_groups__"

_lock = threading.Lock()
_models: "weakref.WeakSet[Any]" = weakref.WeakSet()  # every DDP model built in this process
_kept: list[tuple[Any, list[weakref.ref[Any]]]] = []  # (group, the DDP models that used it)
_c10d_pending: Optional[OnImport] = None
_ddp_pending: Optional[OnImport] = None


def install() -> None:
    """Wrap ``DistributedDataParallel.__init__`` and ``init/destroy_process_group`` now, or each
    once its module loads (torch is never imported here)."""
    global _c10d_pending, _ddp_pending
    with _lock:
        _c10d_pending = now_or_on_import(C10D, "destroy_process_group", _wrap_c10d, _lock, _c10d_pending)
        _ddp_pending = now_or_on_import(DDP, "DistributedDataParallel", _wrap_ddp, _lock, _ddp_pending)


def kept() -> int:
    """How many destroyed groups are held right now."""
    return len(_kept)


def _let_go() -> None:
    """Drop the held groups whose DDP models are all gone."""
    _kept[:] = [(pg, refs) for pg, refs in _kept if any(r() is not None for r in refs)]


def _users(pg: Any) -> list[weakref.ref[Any]]:
    return [weakref.ref(m) for m in list(_models) if getattr(m, "process_group", None) is pg]


def _wrap_ddp(ddp: ModuleType) -> None:
    global _ddp_pending
    _ddp_pending = None
    cls: Any = getattr(ddp, "DistributedDataParallel", None)
    if cls is None or getattr(cls.__init__, _MARK, False):
        return
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _models.add(self)

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__


def _namespaces(c10d: ModuleType) -> list[ModuleType]:
    dist = sys.modules.get("torch.distributed")
    return [c10d] + ([dist] if dist is not None and dist is not c10d else [])


def _wrap_c10d(c10d: ModuleType) -> None:
    global _c10d_pending
    _c10d_pending = None
    destroy: Any = getattr(c10d, "destroy_process_group", None)
    init: Any = getattr(c10d, "init_process_group", None)
    if destroy is None or getattr(destroy, _MARK, False):
        return

    @functools.wraps(destroy)
    def destroy_process_group(group: Any = None, *args: Any, **kwargs: Any) -> Any:
        pg = group
        if pg is None:
            try:
                pg = c10d._get_default_group() if c10d.is_initialized() else None
            except Exception:  # noqa: BLE001 - nothing to keep; the original says what is wrong
                pg = None
        try:
            return destroy(group, *args, **kwargs)
        finally:
            with _lock:
                _let_go()
                users = _users(pg) if pg is not None else []
                if users:
                    _kept.append((pg, users))
            del pg

    setattr(destroy_process_group, _MARK, True)
    swaps = [("destroy_process_group", destroy, destroy_process_group)]
    if init is not None and not getattr(init, _MARK, False):
        @functools.wraps(init)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            with _lock:
                _let_go()
            return init(*args, **kwargs)

        setattr(init_process_group, _MARK, True)
        swaps.append(("init_process_group", init, init_process_group))
    for ns in _namespaces(c10d):
        for name, old, new in swaps:
            if getattr(ns, name, None) is old:
                setattr(ns, name, new)

"""Time this worker spends blocked in ``torch.distributed`` calls: the straggler signal.

Apart from ``worker.py`` (the steps themselves) because it is the one part of the worker side
that patches torch: the ``torch.distributed`` calls made from Python are wrapped (now, or the
moment ``distributed_c10d`` finishes loading; torch is never imported here) to add the time
spent inside them to :data:`total`, and each timed step subtracts what it was blocked from its
duration (``worker._Slot.record``): what is left is the rank's *own* time (data, forward,
backward, a slow fault's sleep), and the rank the others wait for blocks least. The learned
hang judge's collective marks (``marks.collective_entered``/``collective_left``) ride on the
same wrappers.

DDP's gradient all-reduces run in C++ inside ``backward()``, so once a
``DistributedDataParallel`` module has run a forward in this process, ``torch.autograd.backward``
counts as blocked as a whole: a rank slow before it (data, forward, a stall) is seen, one slow
inside backward's own compute is not.
"""
from __future__ import annotations

import functools
import sys
import threading
import time
from types import ModuleType
from typing import Any, Optional

from .._onimport import OnImport, now_or_on_import
from . import marks as _marks

C10D = "torch.distributed.distributed_c10d"
DDP = "torch.nn.parallel.distributed"

total = 0.0  # seconds this process spent inside wrapped torch.distributed calls
_depth = 0  # > 0 while inside one (a collective calling another counts once)
_ddp_ran = False  # a DistributedDataParallel forward ran here: backward() holds its all-reduces
_lock = threading.Lock()
_c10d_pending: Optional[OnImport] = None
_ddp_pending: Optional[OnImport] = None
_wrapped: list[tuple[Any, str, Any]] = []  # (namespace, name, original), for undoing


def time_collectives() -> None:
    """Count the time this process spends inside ``torch.distributed`` calls made from Python
    (now, or the moment ``distributed_c10d`` finishes loading; torch is never imported here)."""
    global _c10d_pending, _ddp_pending
    with _lock:
        _c10d_pending = now_or_on_import(C10D, "all_reduce", _wrap_c10d, _lock, _c10d_pending)
        _ddp_pending = now_or_on_import(DDP, "DistributedDataParallel", _wrap_ddp, _lock, _ddp_pending)


def blocked_seconds() -> float:
    """Seconds this process has spent inside the wrapped calls so far."""
    return total


def _wrap_c10d(c10d: ModuleType) -> None:
    global _c10d_pending
    _c10d_pending = None
    if _wrapped:
        return
    from ..timer.collectives import OPS

    spaces = [c10d] + [m for m in (sys.modules.get("torch.distributed"),) if m is not None and m is not c10d]
    for name in OPS:
        fn = getattr(c10d, name, None)
        if fn is None or not callable(fn):
            continue
        timed = _timed(fn)
        for ns in spaces:
            if getattr(ns, name, None) is fn:
                setattr(ns, name, timed)
                _wrapped.append((ns, name, fn))


def _wrap_ddp(ddp: ModuleType) -> None:
    """``DistributedDataParallel.forward`` notes that DDP runs here; ``torch.autograd.backward``
    (``Tensor.backward`` calls it) counts as blocked from then on."""
    global _ddp_pending
    _ddp_pending = None
    cls = getattr(ddp, "DistributedDataParallel", None)
    autograd: Any = sys.modules.get("torch.autograd")
    if cls is None or autograd is None or any(ns is cls for ns, _, _ in _wrapped):
        return
    forward = cls.forward

    @functools.wraps(forward)
    def ddp_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _ddp_ran
        _ddp_ran = True
        return forward(self, *args, **kwargs)

    cls.forward = ddp_forward
    _wrapped.append((cls, "forward", forward))
    backward = autograd.backward
    autograd.backward = _timed(backward, only_after_ddp=True)
    _wrapped.append((autograd, "backward", backward))


def _timed(fn: Any, only_after_ddp: bool = False) -> Any:
    mono = time.monotonic

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        global total, _depth
        if _depth or (only_after_ddp and not _ddp_ran):
            return fn(*args, **kwargs)
        _depth += 1
        start = mono()
        if _marks._enabled:
            _marks.collective_entered()
        try:
            return fn(*args, **kwargs)
        finally:
            total += mono() - start
            _depth -= 1
            if _marks._enabled:
                _marks.collective_left()
    return call


def untime_collectives() -> None:
    """Put the original functions back (tests)."""
    global _c10d_pending, _ddp_pending
    with _lock:
        for ns, name, fn in reversed(_wrapped):
            if getattr(getattr(ns, name, None), "__wrapped__", None) is fn:
                setattr(ns, name, fn)
        _wrapped.clear()
        for pending in (_c10d_pending, _ddp_pending):
            if pending is not None:
                pending.cancel()
        _c10d_pending = _ddp_pending = None

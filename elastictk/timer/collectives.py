"""Time every ``torch.distributed`` collective and point-to-point call, without script changes.

``watch_collectives(timeout)`` replaces the collective functions of
``torch.distributed.distributed_c10d`` (and their re-exports in ``torch.distributed``) by wrappers
that run each call under a timer whose scope is the op's name, and makes ``Work.wait()`` timed
too (scope ``wait(<op type>)``), so an ``async_op=True`` call is covered while it is issued and
while it is waited for. A rank stuck in ``all_reduce`` because a peer died is then reaped
``timeout`` seconds later with a report naming ``all_reduce`` and the caller's line, instead of
hanging until the backend's own 10-30 minute timeout.

If torch has not been imported yet, nothing is imported now: a meta-path hook patches the module
the moment it finishes loading, so environment variables a script sets before ``import torch``
still take effect and names bound by ``from torch.distributed import all_reduce`` are the timed
ones. Not covered: collectives issued from C++ (DDP's gradient buckets), functional collectives
and process-group methods called directly; wrap those regions with ``expires``.
"""
from __future__ import annotations

import sys
import threading
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

from .._onimport import OnImport, now_or_on_import
from . import client

C10D = "torch.distributed.distributed_c10d"
OPS: tuple[str, ...] = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_coalesced",
    "all_gather_into_tensor", "all_gather_single", "_all_gather_base", "all_gather_object",
    "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "_reduce_scatter_base", "gather", "gather_object", "scatter",
    "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "send_object_list", "recv_object_list",
)
_ORIGINAL = "__elastictk_untimed__"

_lock = threading.Lock()
_timeout: Optional[float] = None
_hook: Optional[OnImport] = None
_ops: tuple[str, ...] = OPS  # what a patch made on import covers
_patched: dict[str, Callable[..., Any]] = {}
_work_wait: Optional[Callable[..., Any]] = None


def watch_collectives(timeout: float, ops: Sequence[str] = OPS) -> None:
    """Run every collective/p2p call (and ``Work.wait``) of this process under a ``timeout``
    second timer. Calling it again changes the timeout; :func:`unwatch_collectives` undoes it."""
    global _timeout, _hook, _ops
    if not 0 < timeout <= client.MAX_AFTER:
        raise client.TimerError(f"collective timeout {timeout!r} must be > 0 seconds")
    with _lock:
        _timeout = float(timeout)
        _ops = tuple(ops)
        _hook = now_or_on_import(C10D, "all_reduce", _on_import, _lock, _hook)


def unwatch_collectives() -> None:
    """Put the original functions back (and drop a pending import hook)."""
    global _timeout, _hook
    with _lock:
        _timeout = None
        if _hook is not None:
            _hook.cancel()
            _hook = None
        module = sys.modules.get(C10D)
        if module is not None:
            _unpatch(module)


def watching() -> Optional[float]:
    """The collective timeout in force, or None."""
    return _timeout


def _namespaces(c10d: ModuleType) -> list[ModuleType]:
    out = [c10d]
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist is not c10d:
        out.append(dist)
    return out


def _patch(c10d: ModuleType, timeout: float, ops: Sequence[str]) -> None:
    _unpatch(c10d)
    for name in ops:
        fn: Any = getattr(c10d, name, None)
        if fn is None or not callable(fn):
            continue
        wrapped = client.timed(fn, timeout, name)
        setattr(wrapped, _ORIGINAL, fn)
        for ns in _namespaces(c10d):
            if getattr(ns, name, None) is fn:
                setattr(ns, name, wrapped)
        _patched[name] = fn
    _patch_init(c10d, timeout)
    _patch_wait(c10d, timeout)


def _patch_init(c10d: ModuleType, timeout: float) -> None:
    """``init_process_group`` without a ``timeout`` gets this one: the backend then gives up on
    a collective (C++ ones included: DDP's gradient buckets) after the launcher's collective
    timeout instead of its own default (30 minutes for gloo and NCCL)."""
    fn: Any = getattr(c10d, "init_process_group", None)
    if fn is None or not callable(fn):
        return

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("timeout") is None and (len(args) < 3 or args[2] is None):
            import datetime

            given = datetime.timedelta(seconds=timeout)
            if len(args) >= 3:  # (backend, init_method, timeout, ...)
                args = (*args[:2], given, *args[3:])
            else:
                kwargs["timeout"] = given
        return fn(*args, **kwargs)

    init_process_group.__doc__ = fn.__doc__
    init_process_group.__wrapped__ = fn  # type: ignore[attr-defined]
    setattr(init_process_group, _ORIGINAL, fn)
    for ns in _namespaces(c10d):
        if getattr(ns, "init_process_group", None) is fn:
            setattr(ns, "init_process_group", init_process_group)
    _patched["init_process_group"] = fn


def _unpatch(c10d: ModuleType) -> None:
    global _work_wait
    for name, fn in _patched.items():
        for ns in _namespaces(c10d):
            current = getattr(ns, name, None)
            if getattr(current, _ORIGINAL, None) is fn:
                setattr(ns, name, fn)
    _patched.clear()
    work = getattr(c10d, "Work", None)
    if work is not None and _work_wait is not None:
        work.wait = _work_wait
    _work_wait = None


def _patch_wait(c10d: ModuleType, timeout: float) -> None:
    """``Work.wait`` under a timer named after the op type (``wait(allreduce)``)."""
    global _work_wait
    work = getattr(c10d, "Work", None)
    if work is None:
        return
    original = work.wait
    ks: dict[Any, int] = {}  # op type -> word constant of a timer named after it
    ns = client._after_ns(timeout)
    generic = ns + client.scope_id("wait") + 1
    pack, mono = client._pack, client._mono
    op_type = _op_type_enum(c10d)

    def k_of(raw: Any) -> int:
        op = raw
        if op_type is not None and isinstance(op, int):
            try:
                op = op_type(op)  # torch hands back the enum's int
            except (ValueError, TypeError):
                pass
        sid = client.scope_id(f"wait({str(getattr(op, 'name', op)).lower()})")
        k = ks[raw] = ns + sid + 1
        return k

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            op = self._get_op_type()
            k = ks.get(op)
            if k is None:
                k = k_of(op)
        except Exception:  # noqa: BLE001 - a Work without an op type is still timed
            k = generic
        try:
            slot = client._free.pop()
        except IndexError:
            slot = client._take_slot_slow()
        pack(client._buf, slot, (mono() | 0xFFFF) + k)
        try:
            return original(self, *args, **kwargs)
        finally:
            pack(client._buf, slot, 0)
            client._free.append(slot)

    wait.__doc__ = original.__doc__
    setattr(wait, _ORIGINAL, original)
    try:
        work.wait = wait
        _work_wait = original
    except (AttributeError, TypeError):  # an immutable extension type: calls are still timed
        pass


def _op_type_enum(c10d: ModuleType) -> Any:
    enum = getattr(c10d, "OpType", None)
    if enum is None:
        c_ext = sys.modules.get("torch._C._distributed_c10d")
        enum = getattr(c_ext, "OpType", None)
    return enum


def _on_import(module: ModuleType) -> None:
    """Patch ``distributed_c10d``, now or the moment it has run, unless
    :func:`unwatch_collectives` came first."""
    global _hook
    _hook = None
    if _timeout is not None:
        _patch(module, _timeout, _ops)

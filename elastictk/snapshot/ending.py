"""The newest commit is on disk when a script ends, or the worker does not exit 0.

A script's last lines are usually ``state.commit()`` then ``dist.destroy_process_group()``.
The disk tier writes in the background, over a gloo group of its own; destroying every group
under that write tears it (``Connection closed by peer``), and the newest commit, the one a
relaunch would want, is lost while the job exits 0. So in a worker with a disk tier,
``torch.distributed.destroy_process_group`` of the default group first lets every live
:class:`~.worker.Snapshotter` finish (:meth:`~.worker.Snapshotter.finish`): the running write
completes while the groups are alive, the newest commit is written if it was not due
(``--snapshot-every``), and the snapshot's own group is destroyed and dropped then, so its C++
destructor (which joins gloo's threads) runs now and not late in interpreter shutdown. A
script that ends without destroying the group gets the same at interpreter exit (``atexit``).

Where that fails, the worker says so in one line and exits 1: from ``destroy_process_group``
with ``SystemExit`` (after the groups are destroyed), at interpreter exit with ``os._exit``.

``run_elastic`` destroys the group itself (``elastictk.inplace.session``). Its close once the
loop finished is the script's end, as above. Its teardown at a failure or a re-forming only
finishes (or fails) the running write and drops the snapshot group: nothing new is written (a
collective while a peer may be gone could hang), and no exit is forced (a save torn by a lost
peer is expected, and is never marked complete).

torch is never imported here: the hook attaches to ``distributed_c10d`` when it is loaded.
"""
from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import weakref
from types import FrameType, ModuleType
from typing import Any, Optional, Protocol

from .._onimport import OnImport, now_or_on_import


class Finishing(Protocol):
    """What is finished here (:class:`~.worker.Snapshotter`; named by shape, no import cycle)."""

    def finish(self, *, write: bool, final: bool) -> Optional[str]: ...

C10D = "torch.distributed.distributed_c10d"
OWN_TEARDOWN = "elastictk.inplace."  # callers whose destroy is run_elastic's, not the script's end
SESSION = "elastictk.inplace.session"  # its close() after the loop finished is the script's end
_MARK = "__elastictk_finishes_snapshots__"

_lock = threading.RLock()
_live: "weakref.WeakSet[Finishing]" = weakref.WeakSet()
_pending: Optional[OnImport] = None
_at_exit = False


def watch(snap: Finishing) -> None:
    """Finish ``snap``'s disk tier when the default group is destroyed or the interpreter exits."""
    global _pending, _at_exit
    with _lock:
        _live.add(snap)
        _pending = now_or_on_import(C10D, "destroy_process_group", _wrap, _lock, _pending)
        if not _at_exit:
            atexit.register(_exiting)
            _at_exit = True


def finish_all(*, write: bool, final: bool) -> list[str]:
    """Every live snapshotter's :meth:`~.worker.Snapshotter.finish`; the problem lines."""
    with _lock:
        snaps = list(_live)
    return [line for line in (s.finish(write=write, final=final) for s in snaps) if line]


def _namespaces(c10d: ModuleType) -> list[ModuleType]:
    dist = sys.modules.get("torch.distributed")
    return [c10d] + ([dist] if dist is not None and dist is not c10d else [])


def _wrap(c10d: ModuleType) -> None:
    global _pending
    _pending = None
    destroy: Any = getattr(c10d, "destroy_process_group", None)
    if destroy is None or getattr(destroy, _MARK, False):
        return

    @functools.wraps(destroy)
    def destroy_process_group(group: Any = None, *args: Any, **kwargs: Any) -> Any:
        world = getattr(getattr(c10d, "GroupMember", None), "WORLD", None)
        if (group is not None and group is not world) or not c10d.is_initialized():
            return destroy(group, *args, **kwargs)
        end = script_ends(sys._getframe(1))
        problems = finish_all(write=end, final=end)
        out = destroy(group, *args, **kwargs)
        if problems:
            raise SystemExit(1)  # the lines are said; the groups are gone: nothing to retry
        return out

    setattr(destroy_process_group, _MARK, True)
    for ns in _namespaces(c10d):
        if getattr(ns, "destroy_process_group", None) is destroy:
            setattr(ns, "destroy_process_group", destroy_process_group)


def script_ends(frame: Optional[FrameType]) -> bool:
    """Whether a destroy called from ``frame`` ends the script: a script's own call, or
    run_elastic's ``Session.close`` with no exception in flight (the loop finished); not
    run_elastic's teardown at a failure or a re-forming, nor its close on the way out of an
    error (a peer may be gone: no collective there)."""
    while frame is not None and frame.f_code.co_name == "destroy_process_group":
        frame = frame.f_back  # another wrapper of it (groupkeep's): its caller decides
    if frame is None or not str(frame.f_globals.get("__name__", "")).startswith(OWN_TEARDOWN):
        return True
    if sys.exc_info()[1] is not None:
        return False
    while frame is not None:
        if frame.f_globals.get("__name__") == SESSION and frame.f_code.co_name == "close":
            return True
        frame = frame.f_back
    return False


def _exiting() -> None:
    """Interpreter exit: the script never destroyed its group (or its destroy was not ours to
    see). Write the newest commit where the group still works and no exception ended the
    script; exit 1 if the newest commit is not on disk."""
    c10d = sys.modules.get(C10D)
    alive = c10d is not None and bool(c10d.is_initialized())
    crashed = getattr(sys, "last_value", None) is not None
    if finish_all(write=alive and not crashed, final=not crashed):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

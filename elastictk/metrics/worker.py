"""Worker-side progress reporting: ``elastictk.metrics.step()`` in the training loop.

The agent creates a steps block (:class:`~elastictk.metrics.steps.WorkerStepsBlock`) and
passes its path in ``ELASTICTK_METRICS_SHM``; each worker maps it once, on its first call, and
from then on a step is a few stores into its own slot (slot = ``LOCAL_RANK``): no syscall, no
lock, no socket, no server per worker. The agent reads the slots when Prometheus scrapes it.

Without ``ELASTICTK_METRICS_SHM`` (the script runs under torchrun, or alone) every call is a
no-op costing one attribute check, so a script can keep the calls wherever it runs.

Usage::

    import elastictk.metrics as etm

    for batch in loader:
        with etm.step_timer():        # times exactly the body; or call etm.step() at the end
            train_step(batch)
        if saved_checkpoint_now:
            etm.checkpoint()          # steps so far survive a restart (see docs/metrics.md)

One training process per local rank reports; a process forked from a reporting worker (a data
loader worker, say) does not, and threads of one worker must not report concurrently.

Scripts that never call ``step()`` are counted too: the steps block names this module in
``ELASTICTK_WORKER_HOOKS`` (see :meth:`~elastictk.metrics.steps.WorkerStepsBlock.env`), so every
worker runs :func:`activate_from_env` at start, which registers torch's global optimizer step
hook once ``torch.optim`` loads (never importing torch itself): each ``optimizer.step()`` of
one optimizer (the first to step) is a step, timed since the previous one. ``run_elastic``
reports each step it runs (:func:`on_loop_step`). Precedence, highest first: the script's own
``step()``/``step_timer()``, ``run_elastic``, the optimizer hook; when a higher source reports
for the first time, the steps the lower one counted in this process are taken back, so no step
counts twice.

The straggler signal (``ELASTICTK_STEPS_COLLECTIVES=1``, set by the agent under
``--straggler-action``): each timed step adds its duration less the time this process was
blocked in ``torch.distributed`` calls (``blocked.py``) to the slot, its *own* time; the rank
the others wait for blocks least (see ``elastictk/agent/stragglers.py``).
"""
from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import sys
import threading
import time
import weakref
from types import ModuleType, TracebackType
from typing import Any, Mapping, Optional

from .._onimport import OnImport, now_or_on_import
from . import blocked as _blocked
from . import marks as _marks
from .layout import (
    BLOCKED_SECONDS, BUCKET0, BUSY_SECONDS, BUSY_STEPS, CHECKPOINTS, CKPT_SECONDS, CKPT_STEPS, EPOCH,
    FIRST_STEP_MONO, H_EPOCH, H_MAGIC, H_SLOTS, H_VERSION,
    LAST_STEP_MONO, LAST_STEP_WALL, LOST_SECONDS, LOST_STEPS, MAGIC, OWNER, PROC_SECONDS, PROC_STEPS, SECONDS,
    SECOND_STEP_MONO, SEQ, STEPS, TIMED, VERSION, block_size, bucket_index, slot_base,
)

ENV_PATH = "ELASTICTK_METRICS_SHM"
ENV_HOOKS = "ELASTICTK_WORKER_HOOKS"
ENV_STACKS = "ELASTICTK_PROGRESS_STACKS"  # "1": attach the timer region at start (stack dumps)
ENV_COLLECTIVES = "ELASTICTK_STEPS_COLLECTIVES"  # "1": time blocked in collectives (stragglers)
HOOK = "elastictk.metrics.worker"
OPTIM = "torch.optim.optimizer"
AUTO, LOOP, USER = 1, 2, 3  # step sources, lowest first
ROLLBACK_MAX = 64  # lower-source steps remembered for taking back

_UNKNOWN, _ENABLED, _DISABLED = 0, 1, 2


class _Slot:
    """This process's slot in the block; the only writer of it while the process lives."""

    __slots__ = ("_mm", "q", "d", "b", "last", "mark")

    def __init__(self, path: str, slot: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size < block_size(1):
                raise ValueError(f"{path} is {size} bytes, too small for a steps block")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        q, d = memoryview(self._mm).cast("Q"), memoryview(self._mm).cast("d")
        if q[H_MAGIC] != MAGIC or q[H_VERSION] != VERSION:
            raise ValueError(f"{path} is not a version-{VERSION} elastictk steps block")
        if not 0 <= slot < q[H_SLOTS]:
            raise ValueError(f"LOCAL_RANK {slot} has no slot in {path} ({q[H_SLOTS]} slots)")
        self.q, self.d, self.b = q, d, slot_base(slot)
        self.last: float | None = None
        self.mark = _blocked.total  # the process's blocked total at its previous step
        self._attach()

    def _attach(self) -> None:
        """Claim the slot. A process that ran here before is gone (the group restarted), so its
        steps after its last checkpoint were lost: the new process resumes from that checkpoint."""
        q, d, b = self.q, self.d, self.b
        if q[b + SEQ] % 2:
            q[b + SEQ] += 1  # the previous owner died mid-update
        q[b + SEQ] += 1
        if q[b + OWNER]:
            q[b + LOST_STEPS] += max(0, q[b + PROC_STEPS] - q[b + CKPT_STEPS])
            d[b + LOST_SECONDS] += max(0.0, d[b + PROC_SECONDS] - d[b + CKPT_SECONDS])
        q[b + PROC_STEPS] = q[b + CKPT_STEPS] = 0
        d[b + PROC_SECONDS] = d[b + CKPT_SECONDS] = 0.0
        d[b + FIRST_STEP_MONO] = d[b + SECOND_STEP_MONO] = 0.0
        q[b + OWNER] = os.getpid()
        q[b + EPOCH] = q[H_EPOCH]
        q[b + SEQ] += 1

    def record(self, seconds: float | None) -> None:
        q, d, b = self.q, self.d, self.b
        q[b + SEQ] += 1
        q[b + STEPS] += 1
        q[b + PROC_STEPS] += 1
        if seconds is not None:
            q[b + TIMED] += 1
            d[b + SECONDS] += seconds
            d[b + PROC_SECONDS] += seconds
            q[b + BUCKET0 + bucket_index(seconds)] += 1
        total = _blocked.total
        blocked, self.mark = total - self.mark, total
        if blocked:
            d[b + BLOCKED_SECONDS] += blocked
        if seconds is not None:
            q[b + BUSY_STEPS] += 1
            d[b + BUSY_SECONDS] += max(0.0, seconds - blocked)
        d[b + LAST_STEP_WALL] = time.time()
        now = d[b + LAST_STEP_MONO] = time.monotonic()
        _marks.note(q, d, b, now)
        if q[b + PROC_STEPS] <= 2:  # a recovery's restore and first step (agent/recovery.py)
            d[b + (FIRST_STEP_MONO if q[b + PROC_STEPS] == 1 else SECOND_STEP_MONO)] = now
        q[b + SEQ] += 1

    def unrecord(self, seconds: float | None) -> None:
        """Take back one step :meth:`record` counted (a higher step source took over)."""
        q, d, b = self.q, self.d, self.b
        q[b + SEQ] += 1
        if q[b + STEPS] and q[b + PROC_STEPS]:
            q[b + STEPS] -= 1
            q[b + PROC_STEPS] -= 1
            if seconds is not None and q[b + TIMED]:
                q[b + TIMED] -= 1
                d[b + SECONDS] -= seconds
                d[b + PROC_SECONDS] -= seconds
                i = b + BUCKET0 + bucket_index(seconds)
                q[i] = max(0, q[i] - 1)
        q[b + SEQ] += 1

    def finish(self) -> None:
        """The script's main code has ended (atexit): from now on this rank makes no steps on
        purpose, so the agent's progress watchdog stops judging it (teardown, a final save)."""
        q, d, b = self.q, self.d, self.b
        q[b + SEQ] += 1
        d[b + LAST_STEP_MONO] = float("inf")
        q[b + SEQ] += 1

    def checkpoint(self) -> None:
        q, d, b = self.q, self.d, self.b
        q[b + SEQ] += 1
        q[b + CKPT_STEPS] = q[b + PROC_STEPS]
        d[b + CKPT_SECONDS] = d[b + PROC_SECONDS]
        q[b + CHECKPOINTS] += 1
        q[b + SEQ] += 1


_state = _UNKNOWN
_slot: _Slot | None = None
_level = 0  # the highest step source seen in this process
_lower: list[float | None] | None = []  # what lower sources recorded (None: too many to undo)


def _open() -> _Slot | None:
    global _state, _slot
    path = os.environ.get(ENV_PATH)
    if not path:
        _state = _DISABLED
        return None
    try:
        _slot = _Slot(path, int(os.environ.get("ELASTICTK_LOCAL_RANK") or os.environ.get("LOCAL_RANK") or 0))
        _state = _ENABLED
        _marks.bind(_slot)
        atexit.register(_finished)
    except (OSError, ValueError) as e:
        _state = _DISABLED
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(f"elastictk.metrics: steps are not reported: cannot use {ENV_PATH}={path}: "
              f"{reason}", file=sys.stderr, flush=True)
    return _slot


def _ready() -> _Slot | None:
    if _slot is not None or _state != _UNKNOWN:
        return _slot
    return _open()


def _finished() -> None:
    if _slot is not None:  # a forked child has none: only the slot's owner says it finished
        _slot.finish()


def step() -> None:
    """Count one finished training step; its duration is the time since the previous step.

    The first step of a process has no previous one, so it is counted but not timed (use
    :func:`step_timer` to time every step exactly).
    """
    s = _slot if _slot is not None else _ready()
    if s is None:
        return
    if _level != USER:
        _outrank(s, USER)
    now = time.monotonic()
    s.record(None if s.last is None else now - s.last)
    s.last = now


def _outrank(s: _Slot, level: int) -> None:
    """Source ``level`` reports for the first time: lower sources' steps are taken back."""
    global _level, _lower
    if _lower:
        for seconds in _lower:
            s.unrecord(seconds)
    _level, _lower = level, ([] if level < USER else None)


def _auto(level: int) -> None:
    """A step from a lower source (the optimizer hook, ``run_elastic``)."""
    if _level > level:
        return
    s = _slot if _slot is not None else _ready()
    if s is None:
        return
    if _level < level:
        _outrank(s, level)
    now = time.monotonic()
    seconds = None if s.last is None else now - s.last
    s.record(seconds)
    s.last = now
    lower = _lower
    if lower is not None:
        if len(lower) < ROLLBACK_MAX:
            lower.append(seconds)
        else:
            globals()["_lower"] = None  # a script this far in without step() will not call it


class StepTimer:
    """``with step_timer(): ...`` counts the body as one step and times it; a body that raises
    is not counted (a failed step is not progress)."""

    __slots__ = ("_start",)

    def __enter__(self) -> "StepTimer":
        self._start = time.monotonic()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            return
        s = _slot if _slot is not None else _ready()
        if s is None:
            return
        if _level != USER:
            _outrank(s, USER)
        now = time.monotonic()
        s.record(now - self._start)
        s.last = now


def step_timer() -> StepTimer:
    return StepTimer()


def checkpoint() -> None:
    """Say that a checkpoint now holds every step so far: a restart no longer loses them.

    Call it after the checkpoint is durably saved. Goodput counts the steps of a failed process
    after its last ``checkpoint()`` as lost (a process that never calls it loses all of them).
    """
    s = _slot if _slot is not None else _ready()
    if s is not None:
        s.checkpoint()


def enabled() -> bool:
    """Whether this process reports steps to an agent (maps the block on first use)."""
    return _ready() is not None


def _after_fork_in_child() -> None:
    """A child of a reporting worker is not the slot's owner; any other child decides afresh."""
    global _state, _slot, _level, _lower
    _state = _DISABLED if _state == _ENABLED else _UNKNOWN
    _slot, _level, _lower = None, 0, []
    _marks.bind(None)


# -- automatic steps: the optimizer hook and run_elastic ---------------------------------------
_lock = threading.Lock()
_handle: Any = None
_pending: Optional[OnImport] = None
_owner: Optional["weakref.ref[Any]"] = None


def activate_from_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Count optimizer steps when this worker reports to an agent (``ELASTICTK_METRICS_SHM``);
    True if the hook is (or will be, once torch.optim loads) registered."""
    global _pending
    env = os.environ if environ is None else environ
    if not env.get(ENV_PATH):
        return False
    if env.get(ENV_STACKS) == "1":  # the agent may ask for a stack dump without a timer
        from ..timer.client import attach_from_env

        attach_from_env()
    with _lock:
        _pending = now_or_on_import(OPTIM, "register_optimizer_step_post_hook", _register, _lock, _pending)
    if env.get(_marks.ENV_MARKS) == "1":  # progress beyond steps (--hang-detection learned)
        _marks.enable()
        _ready()
    if env.get(ENV_COLLECTIVES) == "1" or env.get(_marks.ENV_MARKS) == "1":
        _blocked.time_collectives()
    return True


def deactivate() -> None:
    """Remove the optimizer hook (tests, mostly)."""
    global _handle, _pending, _owner
    with _lock:
        if _handle is not None:
            _handle.remove()
        if _pending is not None:
            _pending.cancel()
        _handle = _pending = _owner = None


def _register(module: ModuleType) -> None:
    global _handle, _pending
    _pending = None
    if _handle is None:
        _handle = module.register_optimizer_step_post_hook(_optimizer_stepped)


def _optimizer_stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
    global _owner
    owner = _owner() if _owner is not None else None
    if owner is None:
        with contextlib.suppress(TypeError):
            _owner = weakref.ref(optimizer)
        owner = optimizer
    if owner is optimizer:
        _auto(AUTO)


def on_loop_step(step: int, *, rank: int, restart_count: int, finished: bool) -> None:
    """``run_elastic``'s report: a step finished (``finished=True``) counts."""
    if finished:
        _auto(LOOP)


os.register_at_fork(after_in_child=_after_fork_in_child)

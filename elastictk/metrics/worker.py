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
"""
from __future__ import annotations

import mmap
import os
import sys
import time
from types import TracebackType

from .layout import (
    BUCKET0, CHECKPOINTS, CKPT_SECONDS, CKPT_STEPS, EPOCH, H_EPOCH, H_MAGIC, H_SLOTS, H_VERSION,
    LAST_STEP_WALL, LOST_SECONDS, LOST_STEPS, MAGIC, OWNER, PROC_SECONDS, PROC_STEPS, SECONDS,
    SEQ, STEPS, TIMED, VERSION, block_size, bucket_index, slot_base,
)

ENV_PATH = "ELASTICTK_METRICS_SHM"

_UNKNOWN, _ENABLED, _DISABLED = 0, 1, 2


class _Slot:
    """This process's slot in the block; the only writer of it while the process lives."""

    __slots__ = ("_mm", "q", "d", "b", "last")

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
        d[b + LAST_STEP_WALL] = time.time()
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


def _open() -> _Slot | None:
    global _state, _slot
    path = os.environ.get(ENV_PATH)
    if not path:
        _state = _DISABLED
        return None
    try:
        _slot = _Slot(path, int(os.environ.get("LOCAL_RANK", "0")))
        _state = _ENABLED
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


def step() -> None:
    """Count one finished training step; its duration is the time since the previous step.

    The first step of a process has no previous one, so it is counted but not timed (use
    :func:`step_timer` to time every step exactly).
    """
    s = _slot if _slot is not None else _ready()
    if s is None:
        return
    now = time.monotonic()
    s.record(None if s.last is None else now - s.last)
    s.last = now


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
    global _state, _slot
    _state = _DISABLED if _state == _ENABLED else _UNKNOWN
    _slot = None


os.register_at_fork(after_in_child=_after_fork_in_child)

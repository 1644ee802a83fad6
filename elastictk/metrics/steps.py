"""The agent's side of worker progress: the shared steps block and what it says about goodput.

:class:`WorkerStepsBlock` owns one small shared memory block with a slot per local rank
(layout in :mod:`elastictk.metrics.layout`). Workers find it through ``ELASTICTK_METRICS_SHM``
(:meth:`WorkerStepsBlock.env`) and write their slot on every step; the agent only reads,
when scraped, and bumps the block's *epoch* when an attempt ends, which marks every step not
yet covered by a checkpoint as lost at that moment (the workers are being stopped and will
resume from their last checkpoint).

By default the block is an anonymous ``memfd`` that workers open as
``/proc/<agent pid>/fd/<fd>``: it has no name to leak, and the kernel frees it when the agent
dies, even by SIGKILL. ``backing="shm"`` uses a named ``/dev/shm/elastictk-steps-*`` segment
instead (for workers that cannot see the agent's ``/proc``); :meth:`close` unlinks it.
"""
from __future__ import annotations

import mmap
import os
import secrets
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Sequence

from .layout import (
    BUCKETS, H_BUCKETS, H_EPOCH, H_MAGIC, H_SLOTS, H_VERSION, MAGIC, VERSION, SlotSnapshot,
    block_size, read_slot,
)
from .worker import ENV_HOOKS, ENV_PATH, HOOK

MAX_WORKERS = 4096
BACKINGS = ("memfd", "shm")


class StepsBlockError(RuntimeError):
    """The steps block could not be created; the message names the cause and the fix."""


class WorkerStepsBlock:
    """One slot per local worker; ``with WorkerStepsBlock(n) as block: spec.env |= block.env()``."""

    def __init__(self, n_workers: int, *, backing: str = "memfd") -> None:
        if not isinstance(n_workers, int) or not 1 <= n_workers <= MAX_WORKERS:
            raise ValueError(f"n_workers {n_workers!r}: need 1..{MAX_WORKERS} (one slot per local rank)")
        if backing not in BACKINGS:
            raise ValueError(f"backing {backing!r}: use one of {', '.join(BACKINGS)}")
        if backing == "memfd" and not hasattr(os, "memfd_create"):
            backing = "shm"
        self.n_workers, self.backing = n_workers, backing
        self._lock = threading.Lock()  # a scrape thread reads while the agent may close
        self._fd: int | None = None
        self._unlink: str | None = None
        size = block_size(n_workers)
        try:
            if backing == "memfd":
                self._fd = os.memfd_create("elastictk-steps", os.MFD_CLOEXEC)
                self.path = f"/proc/{os.getpid()}/fd/{self._fd}"
                fd = self._fd
            else:
                self.path = f"/dev/shm/elastictk-steps-{os.getpid()}-{secrets.token_hex(4)}"
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                self._unlink = self.path
            try:
                os.ftruncate(fd, size)
                self._mm: mmap.mmap | None = mmap.mmap(fd, size)
            finally:
                if backing == "shm":
                    os.close(fd)
        except OSError as e:
            self._release()
            raise StepsBlockError(f"cannot create a {backing} steps block of {size} bytes: "
                                  f"{e.strerror or e}; try backing='shm' or free /dev/shm") from None
        self._q = memoryview(self._mm).cast("Q")
        self._q[H_VERSION], self._q[H_SLOTS], self._q[H_BUCKETS] = VERSION, n_workers, BUCKETS
        self._q[H_MAGIC] = MAGIC  # last: a worker that sees the magic sees a whole header

    # -- for the agent ------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """What every worker's environment needs (the slot is the worker's ``LOCAL_RANK``), and
        :data:`~elastictk.metrics.worker.HOOK` added to the ``ELASTICTK_WORKER_HOOKS`` the
        workers would otherwise get from this process, so scripts that never call ``step()``
        are counted by their optimizer steps."""
        names = [n for n in os.environ.get(ENV_HOOKS, "").split(",") if n.strip()]
        return {ENV_PATH: self.path, ENV_HOOKS: ",".join(names if HOOK in names else [*names, HOOK])}

    @property
    def closed(self) -> bool:
        return self._mm is None

    @property
    def epoch(self) -> int:
        return 0 if self._mm is None else int(self._q[H_EPOCH])

    def end_attempt(self) -> int:
        """Mark the running attempt as ended by a failure or restart; returns the new epoch.

        From now on the pending (not checkpointed) steps of every process that attached
        before this call count as lost, including steps they finish while being stopped.
        """
        with self._lock:
            if self._mm is None:
                return 0
            self._q[H_EPOCH] += 1
            return int(self._q[H_EPOCH])

    def snapshot(self) -> list[SlotSnapshot]:
        """A consistent copy of every slot (empty once closed)."""
        with self._lock:
            if self._mm is None:
                return []
            d = memoryview(self._mm).cast("d")
            try:
                return [read_slot(self._q, d, i) for i in range(self.n_workers)]
            finally:
                d.release()

    def close(self) -> None:
        """Unmap, and free or unlink the block; idempotent. Workers keep their own mapping."""
        with self._lock:
            self._release()

    def _release(self) -> None:
        q = getattr(self, "_q", None)
        if q is not None:
            q.release()
            self._q = None  # type: ignore[assignment]
        mm = getattr(self, "_mm", None)
        if mm is not None:
            mm.close()
        self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._unlink is not None:
            try:
                os.unlink(self._unlink)
            except FileNotFoundError:
                pass
            self._unlink = None

    def __enter__(self) -> "WorkerStepsBlock":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten block must not outlive its owner by name
        try:
            self._release()
        except Exception:
            pass


@dataclass(frozen=True)
class StepTotals:
    """What the slots add up to at one moment, with losses judged against ``epoch``."""

    steps: int
    timed_steps: int
    seconds: float
    lost_steps: int
    lost_seconds: float
    checkpoints: int
    reporting: int  # local ranks that ever reported a step
    last_step_wall: float
    buckets: tuple[int, ...]

    @property
    def useful_seconds(self) -> float:
        return max(0.0, self.seconds - self.lost_seconds)


def lost(slot: SlotSnapshot, epoch: int) -> tuple[int, float]:
    """Steps (and time) of ``slot`` lost to failures so far.

    Earlier processes' losses were settled when their successor attached. The attached
    process's pending steps are lost too once its attempt has ended (``epoch`` moved on since
    it attached): they will be redone from the last checkpoint.
    """
    steps, seconds = slot.lost_steps, slot.lost_seconds
    if slot.used and slot.epoch < epoch:
        ps, pt = slot.pending()
        steps, seconds = steps + ps, seconds + pt
    return steps, seconds


def totals(slots: Sequence[SlotSnapshot], epoch: int) -> StepTotals:
    """Sum the slots; pure, so goodput's arithmetic can be property-tested."""
    lost_pairs = [lost(s, epoch) for s in slots]
    buckets = [0] * BUCKETS
    for s in slots:
        for i, n in enumerate(s.buckets):
            buckets[i] += n
    return StepTotals(
        steps=sum(s.steps for s in slots), timed_steps=sum(s.timed_steps for s in slots),
        seconds=sum(s.seconds for s in slots),
        lost_steps=sum(p[0] for p in lost_pairs), lost_seconds=sum(p[1] for p in lost_pairs),
        checkpoints=sum(s.checkpoints for s in slots),
        reporting=sum(1 for s in slots if s.steps > 0),
        last_step_wall=max((s.last_step_wall for s in slots), default=0.0),
        buckets=tuple(buckets),
    )


def goodput(t: StepTotals, elapsed: float) -> float | None:
    """Useful step time per reporting worker over ``elapsed`` wall seconds, in [0, 1].

    ``None`` while undefined (no step reported yet, or no time elapsed). See docs/metrics.md.
    """
    if t.reporting == 0 or elapsed <= 0:
        return None
    return min(1.0, max(0.0, t.useful_seconds / (t.reporting * elapsed)))

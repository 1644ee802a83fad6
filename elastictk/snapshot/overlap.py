"""Pipelined commits: copy the big tensors while the next step's forward and backward run.

A commit's cost on the training thread is one copy of the state (about 15 ms per 100 MB on
the benchmark machine: 15 % of a 100 ms step). Between a commit and the next optimizer step,
training only *reads* the parameters and the optimizer's state (forward and backward write
activations and gradients, which are not part of the state), so those tensors can be copied by
a background thread during that time, as long as the optimizer waits for the copy before it
changes them. That is what this module arranges (the scheme of CheckFreq, FAST '21):

- :func:`guarded` names the tensors an optimizer owns (its parameters and its state); only
  those are deferred. Everything else (a module's buffers, which forward changes in place; any
  tensor among the plain values) is still copied on the training thread.
- :class:`Gate` is an optimizer step pre-hook that blocks until the background copy is done.
- The copy is checked before it is published: every deferred tensor's version counter
  (``Tensor._version``, bumped by every in-place write) must be what it was at the commit. A
  script that changes a parameter in place outside the optimizer (an EMA written into the
  model, a clamp) would otherwise get a snapshot mixing two steps; instead the commit is not
  published (the previous snapshot stays the newest) and the snapshotter says so in one line
  and copies on the training thread from then on.

The price, stated in docs/snapshots.md: a worker killed while the copy runs (the first few
milliseconds of the next step) leaves the previous commit as its newest, one step older than
with the copy on the training thread.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Optional


def guarded(objects: Iterable[Any]) -> set[int]:
    """``data_ptr`` of every tensor an optimizer among ``objects`` changes in its step: its
    parameters and the tensors of its state (momentum, Adam's moments), on the CPU or a CUDA
    device (a CUDA one is copied on the copy stream, :mod:`.cuda`, and the step waits on it)."""
    import torch

    ptrs: set[int] = set()
    for obj in objects:
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        for group in obj.param_groups:
            for p in group["params"]:
                if p.device.type in ("cpu", "cuda") and p.numel():
                    ptrs.add(p.data_ptr())
        for per_param in obj.state.values():
            for v in per_param.values() if isinstance(per_param, dict) else ():
                if isinstance(v, torch.Tensor) and v.device.type in ("cpu", "cuda") and v.numel():
                    ptrs.add(v.data_ptr())
    return ptrs


class Gate:
    """Blocks an optimizer's step while a commit's deferred copy is still running."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._done.set()
        self._handles: dict[int, Any] = {}
        # CUDA: the copy stream's wait (cuda.CopyStream.before_step), queued by the pre-hook
        self.stream_wait: Optional[Callable[[], None]] = None

    def attach(self, objects: Iterable[Any]) -> None:
        """Hook every optimizer among ``objects`` (once each)."""
        import torch

        for obj in objects:
            if isinstance(obj, torch.optim.Optimizer) and id(obj) not in self._handles:
                self._handles[id(obj)] = obj.register_step_pre_hook(self._before_step)

    def detach(self) -> None:
        for h in self._handles.values():
            h.remove()
        self._handles.clear()

    def opened(self) -> None:
        """A deferred copy starts: optimizer steps wait from now on."""
        self._done.clear()

    def closed(self) -> None:
        self._done.set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)

    def _before_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        if self.stream_wait is not None:  # the step's kernels queue behind the device copy
            self.stream_wait()
        self._done.wait()


def changed(tensors: list[Any], versions: list[int]) -> Optional[int]:
    """Index of the first tensor written in place since its version was taken, else None."""
    for i, (t, v) in enumerate(zip(tensors, versions)):
        if t._version != v:
            return i
    return None

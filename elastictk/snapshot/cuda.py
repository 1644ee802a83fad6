"""The local tier's CUDA path: page-locked slots, copies on a stream of their own, events.

A device-to-host copy into pageable memory goes through a staging buffer at a fraction of the
bus's speed and blocks the host; into page-locked memory it is one DMA that can run beside the
training stream. The agent's slots are shared memory the worker maps, so the worker registers
its mapping of each slot with CUDA (``cudaHostRegister`` through ``torch.cuda.cudart()``, no new
package), once per slot, and unregisters it before the mapping goes (:class:`HostPin`). A slot
that cannot be registered (a locked-memory limit, a driver that refuses shared mappings) is
copied as before, pageable, and one line names the sizes.

:class:`CopyStream` orders the copies with events, never a host sync on the training thread:
``commit()`` records an event on the training stream, the copy stream waits on it, copies every
CUDA tensor of the state with ``non_blocking=True`` into the registered slot and records
``done``. Tensors an optimizer changes in its step are guarded by a stream wait in the step
pre-hook (:meth:`CopyStream.before_step`: the optimizer's kernels queue behind ``done``); any
other CUDA tensor (a buffer forward changes) makes the training stream wait on ``done`` at once.
The background thread waits for ``done`` on the host, checks the version counters, publishes
and checksums the slot, off the training thread. A restore copies host to device, chunked
(:mod:`.into`), from the registered slot.

Every call here that is not a CUDA call is tested on CPU with a stand-in for ``torch.cuda``
(tests/test_snapshot_cuda.py); the CUDA calls are tested where a GPU is (skipped elsewhere).
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable, Optional

CUDA_SUCCESS = 0
REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context


def has_cuda(tensors: list[Any]) -> bool:
    return any(getattr(t, "is_cuda", False) for t in tensors)


def address(view: memoryview) -> int:
    """The address of a writable buffer's first byte (the export is released at once)."""
    c = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(c)
    finally:
        del c


class HostPin:
    """Registers slots with CUDA as page-locked memory, once each; ``close()`` unregisters all
    (call it before the mapping is closed). ``cudart`` is ``torch.cuda.cudart()`` or a stand-in
    with ``cudaHostRegister(ptr, size, flags)`` and ``cudaHostUnregister(ptr)``."""

    def __init__(self, cudart: Optional[Any] = None, say: Callable[[str], None] = print,
                 memory: int = 0) -> None:
        self._cudart = cudart
        self._say, self._memory = say, memory
        self.registered: dict[int, tuple[int, int]] = {}  # slot -> (address, bytes)
        self.refused: dict[int, str] = {}

    def _rt(self) -> Any:
        if self._cudart is None:
            import torch

            self._cudart = torch.cuda.cudart()
        return self._cudart

    @property
    def nbytes(self) -> int:
        """Bytes registered now (counted within --snapshot-memory: they are its slots)."""
        return sum(n for _, n in self.registered.values())

    def register(self, slot: int, view: memoryview) -> bool:
        """Slot ``slot`` page-locked (``view``: all of it); False when CUDA refused it, said once."""
        if slot in self.registered:
            return True
        if slot in self.refused:
            return False
        ptr, size = address(view), len(view)
        err = self._rt().cudaHostRegister(ptr, size, REGISTER_PORTABLE)
        code = int(getattr(err, "value", err))
        if code != CUDA_SUCCESS:
            from .settings import human

            self.refused[slot] = f"cudaHostRegister error {code}"
            self._say(f"snapshot slot {slot} ({human(size)} of --snapshot-memory {human(self._memory)}) "
                      f"cannot be page-locked for CUDA (cudaHostRegister error {code}; "
                      f"{human(self.nbytes)} registered): its device-to-host copies go through "
                      "pageable memory, slower and on the training thread; raise the locked-memory "
                      "limit (ulimit -l) or lower --snapshot-memory")
            return False
        self.registered[slot] = (ptr, size)
        return True

    def close(self) -> None:
        """Unregister every slot (before the mapping goes)."""
        for ptr, _ in self.registered.values():
            self._rt().cudaHostUnregister(ptr)
        self.registered.clear()


class CopyStream:
    """Device-to-host copies on a stream of their own, ordered by events. ``cuda`` is
    ``torch.cuda`` or a stand-in with ``Stream()``, ``Event()``, ``current_stream()`` and
    ``stream(s)``."""

    def __init__(self, cuda: Optional[Any] = None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self.cuda = cuda
        self.stream = cuda.Stream()
        self.done: Optional[Any] = None

    def start(self, copies: list[tuple[Any, Any]], wait_now: bool) -> Any:
        """Queue ``dst.copy_(src, non_blocking=True)`` for each pair after everything the
        training stream queued so far; ``wait_now``: the training stream waits for them at once
        (a tensor forward changes is among them), else only at :meth:`before_step`."""
        ready = self.cuda.Event()
        ready.record(self.cuda.current_stream())
        self.stream.wait_event(ready)
        with self.cuda.stream(self.stream):
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
            done = self.cuda.Event()
            done.record(self.stream)
        self.done = done
        if wait_now:
            self.cuda.current_stream().wait_event(done)
        return done

    def before_step(self) -> None:
        """The optimizer step pre-hook: its kernels wait for the copy (a stream wait)."""
        if self.done is not None:
            self.cuda.current_stream().wait_event(self.done)

    def wait_host(self) -> None:
        """The background thread: block until the copies are done (off the training thread)."""
        done = self.done  # kept: a step queued later still waits on it (a no-op once complete)
        if done is not None:
            done.synchronize()

"""The worker's side of snapshots: write each commit to the tiers (the restore is :mod:`.restoring`).

:class:`Snapshotter` is what ``elastictk.State`` uses when snapshots are on. ``commit`` runs on
the training thread and only serializes the state into a preallocated buffer (the local tier's
inactive slot, else a private buffer); a background thread then checksums it and, every N
steps, writes it to the disk tier. The next ``commit`` waits for that thread, so it blocks only
while the previous snapshot still occupies the buffer. ``restore`` (agree with every rank on
one step, verify it, load it) comes from :class:`~.restoring.Restoring`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional

from . import codec, cuda, ending, overlap, reshard
from .dcp import DcpDisk
from .local import Region
from .restoring import Restored, Restoring, SnapshotError, gather, newest_common, say
from .settings import Settings

__all__ = ["Deferred", "Restored", "SnapshotError", "Snapshotter", "gather", "gather_on",
           "newest_common", "say"]


@dataclass
class Deferred:
    """A pipelined commit's tensors still to copy, and what to go back to if one changes."""

    plan: codec.Plan
    out: memoryview
    indices: list[int]  # copied by the background thread (CPU tensors)
    versions: list[int]  # of ``checked``, at the commit
    previous: Optional[tuple[int, int, int]]
    checked: list[int]  # every deferred tensor (CPU, and CUDA ones on the copy stream)
    # The version check, once: by the optimizer's step pre-hook (a CUDA step is queued behind the
    # copy without waiting on the host, and bumps the versions as it is queued) or, if the
    # background thread gets there first, by it. None: not yet; -1: unchanged; else the index.
    verdict: Optional[int] = None


class Snapshotter(Restoring):
    def __init__(self, settings: Settings, *, rank: int, world: int, local_rank: int,
                 local_world: int) -> None:
        self.settings, self.rank, self.world = settings, rank, world
        self.region: Optional[Region] = None
        if "local" in settings.tiers:
            if settings.regions and settings.region_size:
                self.region = Region(settings.regions, local_rank, settings.region_size,
                                     settings.memory, local_world, notify=settings.notify)
            else:
                say(f"rank {rank}: the local tier needs elastictk-run (its agent owns the memory); "
                    "writing " + ("the disk tier only" if "disk" in settings.tiers else "no snapshot"))
        on_disk = "disk" in settings.tiers
        self.disk = (DcpDisk(settings.directory, rank, world, key=settings.key)
                     if on_disk and settings.directory else None)
        self._private: Optional[bytearray] = None
        self._last: Optional[tuple[int, int, int]] = None  # (step, slot or -1 private, length)
        self._thread: Optional[threading.Thread] = None
        self._warned: set[str] = set()
        self.overlap = settings.overlap  # pipelined commits (overlap.py)
        self.gate = overlap.Gate()
        self._deferred: Optional[Deferred] = None
        self._specs: dict[tuple[Any, ...], reshard.Spec] = {}  # the last commit's DTensors
        self._durable: Optional[int] = None  # the newest step this rank's disk save completed
        self._failed: Optional[tuple[int, str]] = None  # the newest disk save that failed: why
        self._settled: Optional[int] = None  # the step finish() last accounted for
        self._dirty = False  # a torn part was loaded in place: the state's tensors hold its bytes
        self._pin: Optional[cuda.HostPin] = None  # CUDA: the slots page-locked (made on first use)
        self._copy: Optional[cuda.CopyStream] = None
        self._vlock = threading.Lock()
        if self.disk is not None:  # the newest commit on disk when the script ends (ending.py)
            ending.watch(self)

    def moved(self, rank: int, world: int) -> None:
        """This process's rank or world size changed (``run_elastic``: a new generation); later
        commits are this rank's parts in that world."""
        if (rank, world) != (self.rank, self.world):
            self.wait()
            self.rank, self.world = rank, world
            if self.disk is not None:
                self.disk.drop_group()
                self.disk = DcpDisk(str(self.disk.root), rank, world, key=self.settings.key)

    @property
    def active(self) -> bool:
        return self.region is not None or self.disk is not None

    # -- commit -----------------------------------------------------------------------------------
    def commit(self, capture: Any, step: int, guard: frozenset[int] = frozenset()) -> None:
        """``guard``: ``data_ptr`` of the tensors an optimizer hooked to :attr:`gate` changes
        (:func:`.overlap.guarded`); with ``overlap`` on, those are copied in the background."""
        self.wait()
        capture, self._specs = reshard.localize(capture)  # DTensors: their local shards
        plan = codec.Plan(capture)
        deferred = [k for k, t in enumerate(plan.tensors) if t.data_ptr() in guard] if self.overlap else []
        if self.region is not None:
            self.region.check_fits(plan.size, step, self.rank)
            i = self.region.begin()
            out = self.region.data(i)
        else:
            if self._private is None or len(self._private) < plan.size:
                self._private = bytearray(plan.size)
            out, i = memoryview(self._private), -1
        on_stream = self._on_stream(plan, i, out)  # CUDA tensors: DMA into the page-locked slot
        plan.write(out, skip=frozenset(deferred) | frozenset(on_stream))
        if on_stream:
            assert self._copy is not None
            waits = not self.overlap or any(k not in deferred for k in on_stream)  # a buffer forward changes
            self._copy.start(plan.pairs(out, on_stream), wait_now=waits)
            if not self.overlap:
                self._copy.wait_host()  # copy in commit(), as without CUDA
        if deferred:  # published by the background thread once copied and unchanged
            self._deferred = Deferred(plan, out, [k for k in deferred if k not in on_stream],
                                      [plan.tensors[k]._version for k in deferred], self._last, deferred)
            if self._deferred.indices:
                self.gate.opened()  # the CPU copy: the optimizer's step waits on the host
        elif i >= 0:
            assert self.region is not None
            self.region.publish(i, step, plan.size, self.rank, self.world)
        self._last = (step, i, plan.size)
        due = self.disk is not None and step % self.settings.every == 0
        group = self.disk.group() if due and self.disk is not None else None
        self._thread = threading.Thread(target=self._after, args=(step, i, plan.size, due, group),
                                        name="elastictk-snapshot")
        self._thread.start()

    def _check_versions(self, d: Deferred) -> Optional[int]:
        """Index (into ``d.checked``) of a tensor written in place since the commit, else None;
        decided once, before the optimizer's own step writes them (see :class:`Deferred`)."""
        with self._vlock:
            if d.verdict is None:
                bad = overlap.changed([d.plan.tensors[k] for k in d.checked], d.versions)
                d.verdict = -1 if bad is None else bad
            return None if d.verdict < 0 else d.verdict

    def _before_cuda_step(self) -> None:
        """The optimizer step pre-hook on the CUDA path: settle the version check, then queue
        the step's kernels behind the copy (a stream wait, no host sync)."""
        d = self._deferred
        if d is not None:
            self._check_versions(d)
        if self._copy is not None:
            self._copy.before_step()

    def _on_stream(self, plan: codec.Plan, i: int, out: memoryview) -> list[int]:
        """The CUDA tensors of ``plan`` to copy on the copy stream: all of them when slot ``i``
        is page-locked (registered once), else none (copied as before, pageable)."""
        gpu = [k for k, t in enumerate(plan.tensors) if t.is_cuda and t.numel()]
        if not gpu or i < 0 or self.region is None:
            return []
        if not self._pin_slot(i):
            return []
        if self._copy is None:
            self._copy = cuda.CopyStream()
            self.gate.stream_wait = self._before_cuda_step
        return gpu

    def _pin_slot(self, i: int) -> bool:
        """Slot ``i`` page-locked for CUDA (once per slot); False: it stays pageable."""
        assert self.region is not None
        if self._pin is None:
            self._pin = cuda.HostPin(say=lambda line: say(f"rank {self.rank}: {line}"),
                                     memory=self.region.memory)
        return self._pin.register(i, self.region.data(i))

    def _buffer(self, i: int, length: int) -> memoryview:
        if i >= 0:
            assert self.region is not None
            return self.region.data(i)[:length]
        assert self._private is not None
        return memoryview(self._private)[:length]

    def _after(self, step: int, i: int, length: int, due: bool, group: Any) -> None:
        """Background: a pipelined commit's copy, the checksum, then the disk tier when due."""
        if not self._finish_copy(step, i, length):
            return
        try:
            if i >= 0 and self.region is not None:
                self.region.seal(i)
            if due and self.disk is not None:  # DCP from the buffer: it holds the copy
                self._save(step, i, length, group)
        except Exception as e:  # the tier fails, training goes on: say so once per cause
            self._failed = (step, _one_line(e))
            key = type(e).__name__
            if key not in self._warned:
                self._warned.add(key)
                say(f"rank {self.rank}: snapshot of step {step} not written to disk: {e}")

    def _save(self, step: int, i: int, length: int, group: Any) -> None:
        assert self.disk is not None
        tree = codec.read(self._buffer(i, length), clone=False)
        self.disk.save(step, reshard.globalize(tree, self._specs), group)
        self._durable = step

    def finish(self, *, write: bool, final: bool) -> Optional[str]:
        """The default group goes (``ending.py``): finish the running disk write while the
        groups are alive; with ``write`` (the script's end, every rank here), also write the
        newest commit if the disk tier lacks it (it was not due), once every rank's newest
        commit is the same step; then destroy and drop the snapshot's own group. With ``final``
        (the script ends), the line said when the newest commit is not on disk; None when it
        is, when it was accounted for already, or when not ``final`` (run_elastic re-forms).
        """
        self.wait()
        if self.disk is None or self._last is None or self._last[0] == self._settled:
            if self.disk is not None:
                self.disk.drop_group()
            return None
        step, i, length = self._last
        why = ""
        if write:  # every rank decides the same: each says its newest step and whether it is on disk
            try:
                group = self.disk.group()
                views = gather_on(group, (step, step == self._durable), self.world)
                if len({s for s, _ in views}) != 1:
                    why = (f"the ranks' newest commits differ (steps {sorted({s for s, _ in views})}), "
                           "so none is written")
                elif not all(on_disk for _, on_disk in views):
                    self._save(step, i, length, group)  # collective: every rank writes its part
            except Exception as e:  # a peer gone, the directory refused: said below
                why = _one_line(e)
        self.disk.drop_group()
        if step == self._durable:
            self._settled = step
            return None
        if not why and self._failed is not None and self._failed[0] == step:
            why = self._failed[1]
        if not final:
            return None  # run_elastic's teardown: training goes on, its end decides
        gone = not why
        why = why or "the process group was destroyed before it could be written"
        self._settled = step
        kept = f"step {self._durable}" if self._durable is not None else "none"
        line = (f"rank {self.rank}: the newest commit, step {step}, is not on disk ({why}); the "
                f"newest step this rank wrote there is {kept}; exiting 1"
                + ("; call state.flush() before destroying the process group" if gone else ""))
        say(line)
        return line

    def _finish_copy(self, step: int, i: int, length: int) -> bool:
        """Copy the deferred tensors, check none changed meanwhile, publish; False when the
        commit is given up (the previous one stays the newest)."""
        d = self._deferred  # left in place until settled: the step pre-hook reads it meanwhile
        if d is None:
            return True
        try:
            if self._copy is not None:
                self._copy.wait_host()  # the CUDA copies, waited for here: off the training thread
            d.plan.write_tensors(d.out, d.indices)
            bad = self._check_versions(d)
            if bad is None:
                if i >= 0:
                    assert self.region is not None
                    self.region.publish(i, step, length, self.rank, self.world)
                return True
            self._last, self.overlap = d.previous, False
            t = d.plan.tensors[d.checked[bad]]
            kept = f"step {d.previous[0]}" if d.previous is not None else "none"
            say(f"rank {self.rank}: the snapshot of step {step} is dropped: a tensor of the state "
                f"(shape {list(t.shape)}) was changed in place outside the optimizer while it was "
                f"being copied; the newest snapshot stays {kept}, and commits copy on the training "
                "thread from now on (drop --snapshot-overlap for this script)")
            return False
        finally:
            self._deferred = None
            self.gate.closed()

    def wait(self) -> None:
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None

    def last(self) -> Optional[tuple[int, Any]]:
        """``(step, state)`` of the last commit, decoded (tensors cloned)."""
        self.wait()
        if self._last is None:
            return None
        step, i, length = self._last
        return step, reshard.globalize(codec.read(self._buffer(i, length)), self._specs)

    def close(self) -> None:
        self.wait()
        if self.disk is not None:
            self.disk.drop_group()
        self.gate.detach()
        if self._pin is not None:  # before the mapping goes
            self._pin.close()
        if self.region is not None:
            self.region.close()


def gather_on(group: Any, obj: Any, world: int) -> list[Any]:
    """Every rank's ``obj`` over ``group`` (the snapshot's own; None alone: ``[obj]``)."""
    if group is None:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _one_line(e: BaseException) -> str:
    return (str(e).strip() or type(e).__name__).splitlines()[0]

"""The worker's side: write each commit to the tiers, and agree with every rank on what to restore.

:class:`Snapshotter` is what ``elastictk.State`` uses when snapshots are on. ``commit`` runs on
the training thread and only serializes the state into a preallocated buffer (the local tier's
inactive slot, else a private buffer); a background thread then checksums it and, every N
steps, writes it to the disk tier. The next ``commit`` waits for that thread, so it blocks only
while the previous snapshot still occupies the buffer.

``restore`` finds every step this rank holds (local slots, complete disk steps), gathers the
lists from all ranks over the default process group, takes the newest step every rank holds,
and loads it; a part that turns out torn (checksum) is dropped and the ranks agree again, so
all ranks restore the same step, never a mix.
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from . import codec, copies, cuda, ending, into, overlap, reshard
from .dcp import DcpDisk
from .local import Region
from .settings import Settings

TIER_WORDS = {"local": "local memory", "disk": "disk"}


def say(line: str) -> None:
    """One line to stderr in one write (``print`` writes the newline separately, and another
    process's line can land in between)."""
    sys.stderr.write(f"elastictk snapshot: {line}\n")
    sys.stderr.flush()


class SnapshotError(RuntimeError):
    """Snapshots used wrongly, or a setting that cannot work; one line says what to do."""


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


@dataclass
class Restored:
    step: int
    tier: str
    state: Any  # the decoded commit: {"objects": ..., "values": ...}
    seconds: float
    owned: bool = True  # its tensors are the script's own (loaded in place) or fresh; else views


def _dist() -> tuple[Any, bool]:
    import torch.distributed as dist

    return dist, dist.is_available() and dist.is_initialized()


def gather(obj: Any, world: int) -> list[Any]:
    """Every rank's ``obj``, in rank order, over the default group (just ``[obj]`` alone)."""
    if world == 1:
        return [obj]
    dist, ready = _dist()
    if not ready:
        raise SnapshotError("state.restore() with WORLD_SIZE > 1 needs the default process group: "
                            "call torch.distributed.init_process_group() first, so the ranks can "
                            "agree on one step")
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def newest_common(lists: list[list[int]]) -> Optional[int]:
    """The newest step every rank holds (pure)."""
    if not lists:
        return None
    common = set(lists[0]).intersection(*map(set, lists[1:]))
    return max(common) if common else None


class Snapshotter:
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

    # -- restore ----------------------------------------------------------------------------------
    def _sources(self) -> dict[int, list[tuple[str, Any]]]:
        out: dict[int, list[tuple[str, Any]]] = {}
        if self.region is not None:
            for m in self.region.ready(self.rank, self.world):
                out.setdefault(m.step, []).append(("local", m))
        if self.disk is not None:
            for s in self.disk.complete_steps():
                out.setdefault(s, []).append(("disk", s))
            if self.rank == 0:  # the ranks share the directory: one line per refusal
                for s, why in sorted(self.disk.refused.items(), reverse=True):
                    say(f"the snapshot directory {self.disk.root} is refused: {why}; nothing is "
                        "restored from disk" if s < 0 else
                        f"snapshot step {s} in {self.disk.root} refused: {why}; restoring an "
                        "older verified step, if any")
        return out

    def _verify(self, step: int, sources: list[tuple[str, Any]], torn: list[str]
                ) -> Optional[tuple[str, Any, Any]]:
        """The first source of ``step`` that is whole."""
        for tier, src in sources:
            if tier == "local":  # the checksum runs while the part is loaded (into.py)
                why = None if src.checked else "never checksummed: its worker was killed before the check"
                if why is None:
                    return tier, src, None
            else:
                assert self.disk is not None
                why = self.disk.verify(step)  # this rank's share of the step's files
                if why is None:
                    return tier, src, None
            torn.append(f"rank {self.rank}'s {tier} part of step {step} is torn ({why})")
        return None

    def _load(self, step: int, got: tuple[str, Any, Any], torn: list[str],
              template: Callable[[], Any]) -> Optional[tuple[str, Any, Any]]:
        """The agreed step loaded: a local part copied into ``template()``'s tensors while its
        checksum is verified (:func:`.into.load_verified`); a disk step loaded by DCP onto
        ``template()``'s DTensors (resharded). None if it turns out torn."""
        if got[0] == "local":
            assert self.region is not None
            m = got[1]
            self.region.populate(m)
            current = template()
            if cuda.has_cuda([t for _, t in reshard.paths(current)]):  # host to device, page-locked slot
                self._pin_slot(m.index)
            tree, why = into.load_verified(self.region.data(m.index)[:m.length], m.digest, current)
            if why is not None:
                self._dirty = True
                torn.append(f"rank {self.rank}'s local part of step {step} is torn ({why})")
                return None
            return got[0], m, tree
        if got[0] != "disk":
            return got
        assert self.disk is not None
        try:
            return got[0], got[1], self.disk.load(step, template())
        except Exception as e:  # DCP's own errors: a file cut short, a key missing
            torn.append(f"rank {self.rank}'s disk part of step {step} is torn (cannot load it: "
                        f"{(str(e).strip() or type(e).__name__).splitlines()[0]})")
            return None

    def _adopt(self, step: int, tier: str, src: Any, loaded: Any) -> Any:
        """Make the agreed part this rank's last commit; its state, module tensors as views."""
        if tier == "local":
            assert self.region is not None
            self.region.make_active(src.index)
            self._last = (step, src.index, src.length)
            return reshard.globalize(loaded, self._specs)
        raw, self._specs = reshard.encode(loaded)
        if self.region is not None:
            try:
                i = self.region.adopt(step, memoryview(raw), self.rank, self.world)
            except Exception as e:  # too big for the local tier: keep it privately
                say(f"rank {self.rank}: step {step} not copied to local memory: {e}")
            else:
                self._last = (step, i, len(raw))
                return loaded
        self._private = raw
        self._last = (step, -1, len(raw))
        return loaded

    def restore(self, template: Optional[Callable[[], Any]] = None) -> Optional[Restored]:
        """``template()``: the current state (the objects' ``state_dict()``s), whose DTensors
        say how this world shards what is restored."""
        t0 = time.perf_counter()
        cached: list[Any] = []

        def like() -> Any:
            if not cached:
                cached.append(template() if template is not None else None)
            return cached[0]

        self._specs = reshard.specs_like(like()) if template is not None and self.region else {}
        sources = self._sources()
        if self.region is not None:  # another world size (or new ranks): replicated state from any copy
            c = copies.restore(self.region, self.rank, self.world, list(sources), say=say,
                               replicated=not self._specs, gather=lambda o: gather(o, self.world))
            if c is not None:
                self._private, self._last = c.raw or self._private, (c.step, c.slot, c.length)
                state = codec.read(self._buffer(c.slot, c.length), clone=False)
                took = time.perf_counter() - t0
                say(f"rank {self.rank} restored step {c.step} from {c.words} in {took * 1000:.1f} ms")
                return Restored(c.step, "local", state, took, owned=False)
        torn: list[str] = []
        while True:
            lists = gather(sorted(sources), self.world)
            step = newest_common(lists)
            if step is None:
                if torn or any(lists):
                    say(f"rank {self.rank}: no step every rank holds whole; starting from scratch"
                        + (f" ({'; '.join(torn)})" if torn else ""))
                if self.region is not None:
                    self.region.forget()
                if self._dirty:  # no older step to load over the torn bytes already copied in
                    say(f"rank {self.rank}: the state's tensors were loaded from a torn part and no "
                        "older step is whole; exiting 1 so the restart begins from the script's "
                        "initial values")
                    raise SystemExit(1)
                return None
            got = self._verify(step, sources[step], torn)
            oks = gather(got is not None, self.world)
            if all(oks) and got is not None:  # the same on every rank: all gather again
                got = self._load(step, got, torn, like)
                oks = gather(got is not None, self.world)
            if all(oks) and got is not None:
                state = self._adopt(step, *got)
                for line in torn:
                    say(f"{line}; restoring step {step}, the newest step every rank holds whole")
                took = time.perf_counter() - t0
                origin = self.region.origin(got[1].index) if got[0] == "local" and self.region else ""
                say(f"rank {self.rank} restored step {step} from {origin or TIER_WORDS[got[0]]} "
                    f"in {took * 1000:.1f} ms")
                return Restored(step, got[0], state, took)
            del sources[step]  # torn here or elsewhere: unusable for everyone; agree again

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

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

from . import codec
from .disk import Disk
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
class Restored:
    step: int
    tier: str
    state: Any  # the decoded commit: {"objects": ..., "values": ...}; module tensors are views
    seconds: float


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
                                     settings.memory, local_world)
            else:
                say(f"rank {rank}: the local tier needs elastictk-run (its agent owns the memory); "
                    "writing " + ("the disk tier only" if "disk" in settings.tiers else "no snapshot"))
        self.disk = Disk(settings.directory, rank, world) if "disk" in settings.tiers and settings.directory else None
        self._private: Optional[bytearray] = None
        self._last: Optional[tuple[int, int, int]] = None  # (step, slot or -1 private, length)
        self._thread: Optional[threading.Thread] = None
        self._warned: set[str] = set()

    def moved(self, rank: int, world: int) -> None:
        """This process's rank or world size changed (``run_elastic``: a new generation); later
        commits are this rank's parts in that world."""
        if (rank, world) != (self.rank, self.world):
            self.wait()
            self.rank, self.world = rank, world
            if self.disk is not None:
                self.disk = Disk(str(self.disk.root), rank, world)

    @property
    def active(self) -> bool:
        return self.region is not None or self.disk is not None

    # -- commit -----------------------------------------------------------------------------------
    def commit(self, capture: Any, step: int) -> None:
        self.wait()
        plan = codec.Plan(capture)
        if self.region is not None:
            self.region.check_fits(plan.size, step, self.rank)
            i = self.region.begin()
            plan.write(self.region.data(i))
            self.region.publish(i, step, plan.size, self.rank, self.world)
        else:
            if self._private is None or len(self._private) < plan.size:
                self._private = bytearray(plan.size)
            plan.write(memoryview(self._private))
            i = -1
        self._last = (step, i, plan.size)
        due = self.disk is not None and step % self.settings.every == 0
        store = self._store() if due and self.world > 1 else None
        self._thread = threading.Thread(target=self._after, args=(step, i, plan.size, due, store),
                                        name="elastictk-snapshot")
        self._thread.start()

    def _buffer(self, i: int, length: int) -> memoryview:
        if i >= 0:
            assert self.region is not None
            return self.region.data(i)[:length]
        assert self._private is not None
        return memoryview(self._private)[:length]

    def _after(self, step: int, i: int, length: int, due: bool, store: Any) -> None:
        """Background: checksum, then the disk tier when due."""
        try:
            digest = self.region.seal(i) if i >= 0 and self.region is not None else (
                codec.checksum(self._buffer(i, length)) if due else 0)
            if due and self.disk is not None:
                self.disk.write(step, self._buffer(i, length), digest, store)
        except Exception as e:  # the tier fails, training goes on: say so once per cause
            key = type(e).__name__
            if key not in self._warned:
                self._warned.add(key)
                say(f"rank {self.rank}: snapshot of step {step} not written to disk: {e}")

    def _store(self) -> Any:
        dist, ready = _dist()
        if not ready:
            return None
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()

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
        return step, codec.read(self._buffer(i, length))

    # -- restore ----------------------------------------------------------------------------------
    def _sources(self) -> dict[int, list[tuple[str, Any]]]:
        out: dict[int, list[tuple[str, Any]]] = {}
        if self.region is not None:
            for m in self.region.ready(self.rank, self.world):
                out.setdefault(m.step, []).append(("local", m))
        if self.disk is not None:
            for s in self.disk.complete_steps():
                out.setdefault(s, []).append(("disk", s))
        return out

    def _verify(self, step: int, sources: list[tuple[str, Any]], torn: list[str]
                ) -> Optional[tuple[str, Any, Optional[bytearray]]]:
        """The first source of ``step`` that is whole (a disk part comes with its bytes)."""
        for tier, src in sources:
            if tier == "local":
                assert self.region is not None
                why = self.region.verify(src)
                if why is None:
                    return tier, src, None
            else:
                assert self.disk is not None
                raw, why = self.disk.read(step)
                if raw is not None:
                    return tier, src, raw
            torn.append(f"rank {self.rank}'s {tier} part of step {step} is torn ({why})")
        return None

    def _adopt(self, step: int, tier: str, src: Any, raw: Optional[bytearray]) -> Any:
        """Make the agreed part this rank's last commit; its state, module tensors as views."""
        if tier == "local":
            assert self.region is not None
            self.region.make_active(src.index)
            self._last = (step, src.index, src.length)
            return codec.read(self.region.data(src.index)[:src.length], clone=False)
        assert raw is not None
        if self.region is not None:
            try:
                i = self.region.adopt(step, memoryview(raw), self.rank, self.world)
            except Exception as e:  # too big for the local tier: keep it privately
                say(f"rank {self.rank}: step {step} not copied to local memory: {e}")
            else:
                self._last = (step, i, len(raw))
                return codec.read(self.region.data(i)[:len(raw)], clone=False)
        self._private = raw
        self._last = (step, -1, len(raw))
        return codec.read(memoryview(raw), clone=False)

    def restore(self) -> Optional[Restored]:
        t0 = time.perf_counter()
        sources = self._sources()
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
                return None
            got = self._verify(step, sources[step], torn)
            oks = gather(got is not None, self.world)
            if all(oks) and got is not None:
                state = self._adopt(step, *got)
                for line in torn:
                    say(f"{line}; restoring step {step}, the newest step every rank holds whole")
                took = time.perf_counter() - t0
                say(f"rank {self.rank} restored step {step} from {TIER_WORDS[got[0]]} "
                    f"in {took * 1000:.1f} ms")
                return Restored(step, got[0], state, took)
            del sources[step]  # torn here or elsewhere: unusable for everyone; agree again

    def close(self) -> None:
        self.wait()
        if self.region is not None:
            self.region.close()


def clone_tree(x: Any, clone: Callable[[Any], Any]) -> Any:
    if isinstance(x, dict):
        out = type(x)() if type(x) is not dict else {}
        for k, v in x.items():
            out[k] = clone_tree(v, clone)
        return out
    if isinstance(x, list):
        return [clone_tree(v, clone) for v in x]
    if isinstance(x, tuple):
        return tuple(clone_tree(v, clone) for v in x)
    return clone(x)

"""The restore half of a rank's snapshots: agree with every rank on one step, verify it, load it.

``restore`` finds every step this rank holds (local slots, complete disk steps), gathers the
lists from all ranks over the default process group, takes the newest step every rank holds,
and loads it; a part that turns out torn (checksum) is dropped and the ranks agree again, so
all ranks restore the same step, never a mix. It is apart from :mod:`.worker` (the commit
half) because it shares nothing with the commit's pipeline but the slots: its own
collectives, its own failure lines, and the one place a torn part is refused.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from . import codec, copies, cuda, into, reshard
from .dcp import DcpDisk
from .local import Region

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


class Restoring:
    """What :class:`~.worker.Snapshotter` restores with; it holds the attributes below."""

    rank: int
    world: int
    region: Optional[Region]
    disk: Optional[DcpDisk]
    _specs: dict[tuple[Any, ...], reshard.Spec]
    _private: Optional[bytearray]
    _last: Optional[tuple[int, int, int]]
    _dirty: bool

    def _pin_slot(self, i: int) -> bool:
        raise NotImplementedError

    def _buffer(self, i: int, length: int) -> memoryview:
        raise NotImplementedError

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

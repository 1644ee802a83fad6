"""``ElasticSampler``: ``DistributedSampler``'s drop-in whose place in the epoch survives a restart.

``DistributedSampler`` fixes each rank's share of an epoch when it is built (every
``world``-th index), so a job that resumes mid-epoch can only replay the epoch or skip it, and a
job that resumes at another world size would split the epoch differently. ``ElasticSampler``
keeps one global number, the epoch's *position* (samples already trained by all ranks), and
cuts the rest of the epoch into global batches from there (elastictk/data/plan.py), reading the
rank and world size at each pass. ``state_dict()`` is that position as plain ints, so the
sampler goes into ``State(..., sampler=sampler)`` and ``state.restore()`` brings it back.

Which samples are *trained*: a ``DataLoader`` with ``num_workers > 0`` pulls indices batches
ahead of the loop, so what the sampler handed out is not what was trained. The exact count is
the number of batches the loop took from the loader: ``elastictk.data.DataLoader`` (torch's,
same arguments) reports each one here. Without it the sampler counts the batches it started
handing out, which is exact for ``num_workers=0`` and says once when a multi-worker torch
loader is iterating it.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sized

from torch.utils.data import Sampler

from . import plan, record
from .world import rank_world

log = logging.getLogger("elastictk.data")

_MAX = 2**63 - 1


class SamplerStateError(ValueError):
    """A saved sampler state that cannot be this sampler's (wrong type, range, dataset or seed)."""


@dataclass
class _Pass:
    """One iteration over the rest of an epoch: its cut and how far the loop got."""

    epoch: int
    rank: int
    world: int
    cut: plan.Cut
    order: list[int]
    by_loader: bool
    started: int = 0          # batches whose first index the iterator handed out
    handed: int = 0           # batches the loop took from elastictk.data.DataLoader
    finished: bool = False    # the loop saw the end (by_loader) / the iterator ran out
    notes: list[str] = field(default_factory=list)

    def position(self) -> int:
        if self.finished:
            return self.cut.size
        return self.cut.position_after(self.handed if self.by_loader else self.started)


class ElasticSampler(Sampler[int]):
    """``DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last)`` plus
    ``batch_size``: the per-rank batch size of the loader, which cuts the global batches
    (``elastictk.data.DataLoader`` fills it in from its own ``batch_size``).

    ``num_replicas``/``rank`` left out are read at every pass from the default process group
    (else ``WORLD_SIZE``/``RANK``), so one sampler follows a job whose world size changes.
    ``set_epoch(e)`` starts epoch ``e`` at position 0, except for the epoch the sampler is in
    (a restored one): that keeps its position, so the usual loop resumes mid-epoch::

        for epoch in range(sampler.epoch, epochs):
            sampler.set_epoch(epoch)
            for batch in loader: ...

    ``epoch`` is the epoch the sampler is in (restored by ``state.restore()``, moved by
    ``set_epoch``); ``position`` is how many of its samples all ranks together have trained.
    Torch's own ``DataLoader(dataset, batch_size=B, sampler=sampler)`` works as it does with
    ``DistributedSampler`` (exact with ``num_workers=0``); ``elastictk.data.DataLoader`` (same
    arguments) is exact with workers too, as it counts the batches the loop took.
    """

    def __init__(self, dataset: Sized, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 batch_size: Optional[int] = None) -> None:
        _check_dataset(dataset)
        seed = _whole("seed", seed)
        shuffle = _flag("shuffle", shuffle)
        drop_last = _flag("drop_last", drop_last)
        if num_replicas is not None:
            num_replicas = _whole("num_replicas", num_replicas)
        if rank is not None:
            rank = _whole("rank", rank)
        if num_replicas is not None and num_replicas < 1:
            raise ValueError(f"ElasticSampler(num_replicas={num_replicas}): at least 1")
        if rank is not None and (rank < 0 or (num_replicas is not None and rank >= num_replicas)):
            raise ValueError(f"ElasticSampler(rank={rank}): must be in [0, num_replicas - 1]")
        if batch_size is not None and (isinstance(batch_size, bool) or batch_size < 1):
            raise ValueError(f"ElasticSampler(batch_size={batch_size!r}): a per-rank batch size >= 1")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.batch_size = batch_size
        self.epoch = 0
        self._position = 0
        self._pass: Optional[_Pass] = None
        self._generation = 0          # moves when the position is set from outside (loaders restart)
        self._loader_next = False     # the next pass is counted by elastictk.data.DataLoader
        self._finished_here = False   # this process ran the current epoch to its end
        self._restored_epoch: Optional[int] = None
        self._said: set[str] = set()

    # -- position ---------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Samples of the current epoch already trained, by all ranks together."""
        return self._pass.position() if self._pass is not None else self._position

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at position 0; the epoch the sampler is already in keeps its place."""
        epoch = int(epoch)
        if epoch == self.epoch:
            return
        if self._restored_epoch is not None and epoch < self._restored_epoch:
            self._say("back", f"ElasticSampler.set_epoch({epoch}) goes back before the restored "
                      f"epoch {self._restored_epoch}: its samples train again; loop from "
                      "sampler.epoch")
        self._moved(epoch, 0)

    def state_dict(self) -> dict[str, int]:
        """Plain ints: the epoch, its trained position, the seed and the dataset's size."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "samples": len(self.dataset)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``'s position: the next pass starts at the first untrained sample,
        and a running ``elastictk.data.DataLoader`` iterator restarts there."""
        got = check_state(state, samples=len(self.dataset), seed=self.seed)
        self._moved(got["epoch"], got["position"])
        self._restored_epoch = got["epoch"]

    def _moved(self, epoch: int, position: int) -> None:
        self.epoch, self._position = epoch, position
        self._pass = None
        self._finished_here = False
        self._generation += 1

    # -- iteration --------------------------------------------------------------------------
    def world(self) -> tuple[int, int]:
        """(rank, world size) for the next pass."""
        if self.num_replicas is not None and self.rank is not None:
            return self.rank, self.num_replicas
        rank, world = rank_world()
        world = self.num_replicas if self.num_replicas is not None else world
        rank = self.rank if self.rank is not None else rank
        if not 0 <= rank < world:
            raise ValueError(f"ElasticSampler: rank {rank} is not in a world of {world}; pass "
                             "num_replicas and rank that agree, or leave both out")
        return rank, world

    def _batch(self) -> int:
        if self.batch_size is None:
            found = _torch_batch_size(self)
            if found is None:
                raise ValueError("ElasticSampler needs batch_size=<the loader's per-rank batch "
                                 "size> to cut global batches: give it to the sampler, or iterate "
                                 "it through a DataLoader(batch_size=...), torch's or "
                                 "elastictk.data's")
            self.batch_size = found
        return self.batch_size

    def _start(self) -> _Pass:
        rank, world = self.world()
        size = len(self.dataset)
        start = self.position
        if start >= size and self._finished_here:  # a second pass without set_epoch
            self._say("again", f"ElasticSampler: epoch {self.epoch} is iterated again without "
                      "set_epoch(): it repeats the same order from its start (as "
                      "DistributedSampler does); call sampler.set_epoch(epoch) every epoch")
            start = 0
        self._position = start
        cut = plan.cut(size, start, self._batch(), rank, world, self.drop_last)
        self._tell(cut, world)
        by_loader, self._loader_next = self._loader_next, False
        if not by_loader:
            record.off("an ElasticSampler iterated by torch's DataLoader: which batches were "
                       "trained is not known; use elastictk.data.DataLoader (same arguments)")
        if not by_loader and _multiworker_torch_loader():
            self._say("prefetch", "ElasticSampler: a torch DataLoader with num_workers > 0 "
                      "prefetches batches, so the position committed would count them as "
                      "trained; use elastictk.data.DataLoader (same arguments), which counts "
                      "the batches the loop took")
        self._finished_here = False
        self._pass = _Pass(self.epoch, rank, world, cut,
                           plan.order(size, self.epoch, self.seed, self.shuffle), by_loader)
        return self._pass

    def __iter__(self) -> Iterator[int]:
        return self._indices(self._start())

    def _indices(self, p: _Pass) -> Iterator[int]:
        size = p.cut.size
        for k, offsets in enumerate(p.cut.batches):
            p.started = k + 1
            for o in offsets:
                yield p.order[o % size]
        if not p.by_loader:
            p.finished = True
            self._finished_here = True

    def __len__(self) -> int:
        """The indices this rank takes in a pass from the current position."""
        rank, world = self.world()
        batch = self.batch_size if self.batch_size is not None else _torch_batch_size(self)
        cut = plan.cut(len(self.dataset), min(self.position, len(self.dataset)), batch or 1,
                       rank, world, self.drop_last)
        return sum(len(b) for b in cut.batches)

    # -- what elastictk.data.DataLoader reports ---------------------------------------------
    def _expect_loader(self) -> None:
        self._loader_next = True

    def _handed(self, p: Optional[_Pass]) -> None:
        if p is not None and p is self._pass:
            p.handed += 1
            if record.on() and p.handed <= len(p.cut.batches):
                size = p.cut.size
                offsets = p.cut.batches[p.handed - 1]
                record.batch(p.epoch, [p.order[o] for o in offsets if o < size],
                             [p.order[o % size] for o in offsets if o >= size], size)

    def _loader_finished(self, p: Optional[_Pass]) -> None:
        if p is not None and p is self._pass:
            p.finished = True
            self._finished_here = True
            if record.on():
                size = p.cut.size
                record.end(p.epoch, p.order[size - p.cut.dropped:size] if p.cut.dropped else [], size)

    def _tell(self, cut: plan.Cut, world: int) -> None:
        if cut.padded:
            self._say("pad", f"ElasticSampler: the epoch's last global batch does not divide "
                      f"among {world} ranks; it is padded with {cut.padded} samples from the "
                      "epoch's start (as DistributedSampler pads; drop_last=True leaves the "
                      "remainder out instead)")
        if cut.dropped:
            self._say("drop", f"ElasticSampler: drop_last=True leaves the epoch's last "
                      f"{cut.dropped} samples out (fewer than the {world} ranks)")

    def _say(self, key: str, line: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning("%s", line)


def check_state(state: Any, *, samples: int, seed: int) -> dict[str, int]:
    """A saved sampler state, checked: a mapping of plain ints in range, for this dataset's
    size and this seed. Anything else raises ``SamplerStateError`` naming what is wrong."""
    if not isinstance(state, Mapping):
        raise SamplerStateError(f"sampler state is a {type(state).__name__}, not a dict of "
                                "epoch/position/seed/samples; was it saved by ElasticSampler?")
    got: dict[str, int] = {}
    for key in ("epoch", "position", "seed", "samples"):
        value = state.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not -_MAX <= value <= _MAX:
            raise SamplerStateError(f"sampler state's {key} is {_short(value)}, not an int; "
                                    "was it saved by ElasticSampler?")
        got[key] = value
    if got["samples"] != samples:
        raise SamplerStateError(f"sampler state is for a dataset of {got['samples']} samples, "
                                f"this one has {samples}: positions would name other samples")
    if got["seed"] != seed:
        raise SamplerStateError(f"sampler state was saved with seed={got['seed']}, this sampler "
                                f"has seed={seed}: build it with seed={got['seed']} to resume "
                                "the same order")
    if got["epoch"] < 0 or not 0 <= got["position"] <= samples:
        raise SamplerStateError(f"sampler state's epoch {got['epoch']} / position "
                                f"{got['position']} is out of range (epoch >= 0, 0 <= position "
                                f"<= {samples})")
    return got


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_dataset(dataset: Any) -> None:
    """A map-style dataset with a length: the sampler hands out its indices."""
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset):
        raise TypeError(f"ElasticSampler({type(dataset).__name__}): an IterableDataset has no "
                        "indices to sample; use a map-style Dataset (with __getitem__ and "
                        "__len__), or shard the stream by rank yourself without a sampler")
    try:
        size = len(dataset)
    except TypeError:
        raise TypeError(f"ElasticSampler(dataset): needs a map-style dataset with len(), got "
                        f"{_short(dataset)} ({type(dataset).__name__})") from None
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise TypeError(f"ElasticSampler(dataset): len(dataset) is {_short(size)}, not a "
                        "count of samples")


def _whole(name: str, value: Any) -> int:
    """An int argument (numpy and torch ints included), never a bool or a string."""
    import operator

    if isinstance(value, bool):
        raise TypeError(f"ElasticSampler({name}={value!r}): an int, not a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"ElasticSampler({name}={_short(value)}): an int") from None


def _flag(name: str, value: Any) -> bool:
    """A bool argument: a string such as 'no' is truthy and would silently mean True."""
    if isinstance(value, bool):
        return value
    import numbers

    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(value)
    raise TypeError(f"ElasticSampler({name}={_short(value)}): True or False")


def _torch_batch_size(sampler: "ElasticSampler") -> Optional[int]:
    """The per-rank batch size of torch's ``BatchSampler`` that is iterating (or measuring)
    ``sampler`` right now: how a plain ``torch.utils.data.DataLoader(ds, batch_size=B,
    sampler=ElasticSampler(ds))`` works as it does with ``DistributedSampler``. None when the
    caller is not a batch sampler over this sampler."""
    from torch.utils.data import BatchSampler

    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, BatchSampler) and owner.sampler is sampler:
            size = owner.batch_size
            if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
                if owner.drop_last:
                    sampler._say("batch-drop", "ElasticSampler under DataLoader(drop_last=True): "
                                 "the loader drops a short last batch that the position counts as "
                                 "trained; pass ElasticSampler(drop_last=True) instead")
                return size
            return None
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _multiworker_torch_loader() -> bool:
    """Whether torch's multi-worker loader iterator is what starts this pass (it prefetches)."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        owner = frame.f_locals.get("self")
        if type(owner).__name__ == "_MultiProcessingDataLoaderIter":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False

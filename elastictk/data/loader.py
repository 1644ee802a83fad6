"""``elastictk.data.DataLoader``: torch's ``DataLoader``, counting the batches the loop took.

With ``num_workers > 0`` torch's loader pulls indices from its sampler batches ahead of the
loop (``prefetch_factor * num_workers``), so a sampler alone cannot know which of them were
trained when ``state.commit()`` runs. This loader's iterator tells its ``ElasticSampler`` each
time it hands a batch to the loop, and when the loop saw the end of the epoch: the position a
commit saves is then exactly the batches trained (a commit runs after the step that trained
its batch). It is a subclass with the same arguments; with any other sampler it is torch's
loader unchanged.

Under ``elastictk-chaos`` the batches handed to the loop are recorded (elastictk/data/record.py):
an ``ElasticSampler``'s from its cut, a ``DistributedSampler``'s from its order (it is
deterministic per epoch), so the chaos run judges either from what the job trained; a loader
over any other sampler (an evaluation loader, say) writes nothing and is not judged.

When the sampler's position is set from outside while an iterator is running
(``state.rollback()`` or ``load_bytes`` in place, ``load_state_dict``), or the world size
changed, the iterator drops its prefetched batches and goes on from the new position.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

import torch.utils.data

from . import record
from .sampler import ElasticSampler, _Pass


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` with an ``ElasticSampler`` counted exactly (see module).

    ``DataLoader(dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
    num_workers=0, collate_fn=None, pin_memory=False, drop_last=False, ...)``: torch's arguments,
    unchanged. With an ``ElasticSampler`` it needs ``batch_size`` (the per-rank batch size, given
    to the sampler if it has none) and takes ``drop_last`` from the sampler instead.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        sampler = self.sampler
        if not isinstance(sampler, ElasticSampler):
            return
        if self.batch_size is None:
            raise ValueError("elastictk.data.DataLoader with an ElasticSampler needs batch_size "
                             "(a batch_sampler would regroup the global batches)")
        if sampler.batch_size is None:
            sampler.batch_size = self.batch_size
        elif sampler.batch_size != self.batch_size:
            raise ValueError(f"ElasticSampler(batch_size={sampler.batch_size}) but "
                             f"DataLoader(batch_size={self.batch_size}): give both the same "
                             "per-rank batch size")
        if self.drop_last:
            raise ValueError("DataLoader(drop_last=True) with an ElasticSampler would drop a "
                             "short batch the position counts as trained; pass "
                             "ElasticSampler(drop_last=True) instead")

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # torch's iterator, wrapped
        sampler = self.sampler
        if not isinstance(sampler, ElasticSampler):
            if record.on() and isinstance(sampler, torch.utils.data.DistributedSampler) \
                    and self.batch_size is not None:
                return _recorded(self, super().__iter__())
            return super().__iter__()  # another sampler: not judged (no line at all)
        return _Counted(self, sampler)

    def _torch_iter(self) -> Iterator[Any]:
        return super().__iter__()


class _Counted:
    """The loop's iterator: torch's, plus a report to the sampler per batch taken."""

    def __init__(self, loader: DataLoader, sampler: ElasticSampler) -> None:
        self._loader = loader
        self._sampler = sampler
        self._base: Optional[Iterator[Any]] = None
        self._pass: Optional[_Pass] = None
        self._generation = -1
        self._done = False

    def __iter__(self) -> "_Counted":
        return self

    def _fresh(self) -> Iterator[Any]:
        self._sampler._expect_loader()
        self._generation = self._sampler._generation
        self._pass = None
        self._base = self._loader._torch_iter()
        return self._base

    def _stale(self) -> bool:
        """The sampler was moved, or the world it cut for is not the world now."""
        if self._generation != self._sampler._generation:
            return True
        p = self._pass
        return p is not None and p is self._sampler._pass and (p.rank, p.world) != self._sampler.world()

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        base = self._base if self._base is not None and not self._stale() else self._fresh()
        try:
            batch = next(base)
        except StopIteration:
            self._done = True
            self._sampler._loader_finished(self._pass or self._sampler._pass)
            raise
        if self._pass is None:
            self._pass = self._sampler._pass
        self._sampler._handed(self._pass)
        return batch

    def __len__(self) -> int:
        return len(self._loader)


def _recorded(loader: DataLoader, base: Iterator[Any]) -> Iterator[Any]:
    """torch's iterator over a ``DistributedSampler``, each batch handed recorded with the
    indices the sampler gave for it."""
    sampler = loader.sampler
    assert isinstance(sampler, torch.utils.data.DistributedSampler) and loader.batch_size is not None
    size = len(sampler.dataset)  # type: ignore[arg-type]
    mine = list(iter(sampler))  # deterministic for its epoch: the same order torch's loader takes
    world, rank = sampler.num_replicas, sampler.rank
    bs = loader.batch_size
    epoch = sampler.epoch
    taken = 0
    for item in base:
        part = mine[taken:taken + bs]
        padded = [rank + (taken + k) * world >= size for k in range(len(part))]
        record.batch(epoch, [i for i, p in zip(part, padded) if not p],
                     [i for i, p in zip(part, padded) if p], size)
        taken += len(part)
        yield item
    left_out = mine[taken:]  # DataLoader(drop_last=True): the short last batch
    if sampler.drop_last:
        left_out += _ds_dropped(sampler, size)
    record.end(epoch, left_out, size)


def _ds_dropped(sampler: torch.utils.data.DistributedSampler[Any], size: int) -> list[int]:
    """The indices ``DistributedSampler(drop_last=True)`` leaves out of every rank's share."""
    if sampler.shuffle:
        g = torch.Generator()
        g.manual_seed(sampler.seed + sampler.epoch)
        perm = torch.randperm(size, generator=g).tolist()
    else:
        perm = list(range(size))
    return perm[sampler.total_size:]

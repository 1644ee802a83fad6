"""Where an epoch's samples go: pure functions over ints, no torch, no processes.

An epoch is one order of the dataset (a seeded permutation, as ``DistributedSampler`` draws
it) cut into *global batches* of ``batch * world`` samples. Rank ``r`` takes the ``r``-th run
of ``batch`` samples of every global batch. The place in the epoch is one global number, the
*position*: how many samples of the order are behind us. Because the position counts samples
and not per-rank batches, a job that resumes at another world size cuts the rest of the order
into its own global batches from that position on: nothing behind it is taken again, nothing
after it is left out.

The rest of the order rarely divides into whole global batches. Its last, short global batch
is shared evenly: with ``drop_last`` the fewer-than-``world`` samples that do not divide are
left out (as ``DistributedSampler`` drops them); without, it is padded up to a multiple of
``world`` with the first samples of the order (as ``DistributedSampler`` pads), so every rank
takes the same number of batches and collectives stay matched.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cut:
    """One rank's share of the rest of an epoch, from ``start`` on.

    ``batches[k]`` are offsets into the epoch's order (an offset past the end is padding: it
    names offset ``o % size``); after the loop has trained batch ``k`` on every rank the epoch's
    position is ``ends[k]``. ``padded`` and ``dropped`` say what the short last global batch
    did (the same on every rank)."""

    size: int
    start: int
    batches: tuple[tuple[int, ...], ...]
    ends: tuple[int, ...]
    padded: int
    dropped: int

    def position_after(self, trained: int) -> int:
        """The epoch's position once the first ``trained`` batches of this cut are trained."""
        if trained <= 0:
            return self.start
        return self.ends[min(trained, len(self.ends)) - 1]


def cut(size: int, start: int, batch: int, rank: int, world: int, drop_last: bool) -> Cut:
    """Rank ``rank``'s batches of the order's offsets ``[start, size)`` at world size ``world``."""
    if batch < 1 or world < 1 or not 0 <= rank < world or not 0 <= start <= size:
        raise ValueError(f"cut(size={size}, start={start}, batch={batch}, rank={rank}, "
                         f"world={world}): needs batch, world >= 1, 0 <= rank < world and "
                         "0 <= start <= size")
    whole = batch * world
    batches: list[tuple[int, ...]] = []
    ends: list[int] = []
    at = start
    while size - at >= whole:
        first = at + rank * batch
        batches.append(tuple(range(first, first + batch)))
        at += whole
        ends.append(at)
    tail = size - at
    padded = dropped = 0
    if tail:
        if drop_last:
            each = tail // world
            dropped = tail - each * world
        else:
            each = -(-tail // world)
            padded = each * world - tail
        if each:
            first = at + rank * each
            batches.append(tuple(range(first, first + each)))
            ends.append(size)
    return Cut(size, start, tuple(batches), tuple(ends), padded, dropped)


def order(size: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The epoch's order of dataset indices: ``DistributedSampler``'s (``randperm`` seeded with
    ``seed + epoch``), so switching samplers keeps a job's data order."""
    if not shuffle:
        return list(range(size))
    import torch

    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(size, generator=g).tolist()

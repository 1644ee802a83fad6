"""Sharded state (DTensor, what FSDP2's ``fully_shard`` makes) in the snapshot tiers.

The local tier's buffer holds plain bytes, so a commit keeps each DTensor's *local shard*
(:func:`localize`) and remembers how to rebuild the DTensor around it (:class:`Spec`: mesh,
placements, global shape and stride). The disk tier hands DCP the DTensors again
(:func:`globalize`), which is what lets a later job of another world size load them resharded.
A restore from the local tier (same rank, same world size) rebuilds them from the current
objects' own DTensors (:func:`specs_like`), since the process that committed is gone.

Tensors are addressed by their path in the state tree (:func:`paths`), the same walk for every
tree of the same structure, so a spec found in one tree applies to the same place in another.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator


@dataclass(frozen=True)
class Spec:
    mesh: Any
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _is_dtensor(x: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(x, DTensor)


def paths(tree: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every tensor leaf of ``tree`` with its path (dict keys and list indices), in order."""
    import torch

    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from paths(v, (*prefix, i))


def remap(tree: Any, fn: Callable[[tuple[Any, ...], Any], Any], prefix: tuple[Any, ...] = ()) -> Any:
    """``tree`` with every tensor leaf replaced by ``fn(path, tensor)``; containers copied."""
    import torch
    from collections import OrderedDict

    if isinstance(tree, torch.Tensor):
        return fn(prefix, tree)
    if isinstance(tree, dict):
        out = OrderedDict() if isinstance(tree, OrderedDict) else {}
        for k, v in tree.items():
            out[k] = remap(v, fn, (*prefix, k))
        return out
    if isinstance(tree, list):
        return [remap(v, fn, (*prefix, i)) for i, v in enumerate(tree)]
    if isinstance(tree, tuple):
        return tuple(remap(v, fn, (*prefix, i)) for i, v in enumerate(tree))
    return tree


def localize(tree: Any) -> tuple[Any, dict[tuple[Any, ...], Spec]]:
    """``tree`` with each DTensor replaced by its local shard, and the specs to rebuild them."""
    specs: dict[tuple[Any, ...], Spec] = {}
    found = False

    def local(path: tuple[Any, ...], t: Any) -> Any:
        nonlocal found
        if not _is_dtensor(t):
            return t
        found = True
        specs[path] = Spec(t.device_mesh, tuple(t.placements), tuple(t.shape), tuple(t.stride()))
        return t.to_local()

    out = remap(tree, local)
    return (out if found else tree), specs


def specs_like(template: Any) -> dict[tuple[Any, ...], Spec]:
    """The specs of the DTensors in ``template`` (the current objects' state), by path."""
    return localize(template)[1]


def globalize(tree: Any, specs: dict[tuple[Any, ...], Spec]) -> Any:
    """``tree`` with the local shards at ``specs``' paths wrapped as DTensors again (no copy)."""
    if not specs:
        return tree
    from torch.distributed.tensor import DTensor

    def wrap(path: tuple[Any, ...], t: Any) -> Any:
        s = specs.get(path)
        if s is None or _is_dtensor(t):
            return t
        import torch

        return DTensor.from_local(t, s.mesh, s.placements, run_check=False,
                                  shape=torch.Size(s.shape), stride=s.stride)

    return remap(tree, wrap)


def encode(tree: Any) -> tuple[bytearray, dict[tuple[Any, ...], Spec]]:
    """``tree`` in the codec's format (its DTensors as local shards), and their specs: how a
    step loaded from disk becomes this rank's last commit."""
    from . import codec

    local, specs = localize(tree)
    plan = codec.Plan(local)
    raw = bytearray(plan.size)
    plan.write(memoryview(raw))
    return raw, specs

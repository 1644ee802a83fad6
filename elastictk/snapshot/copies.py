"""Replicated state from any copy: the local tier at another world size (or with new ranks).

A local slot is tagged with the rank and world size that committed it, and a part restores
that rank in that world. When the world changes between save and restore (a node left or
joined and the job restarted), no rank of the new world holds a part of its own. For
*replicated* state (no DTensor in it: DDP-style, every rank holds the same, as
:mod:`.reshard` decides for the disk tier too), any rank's whole copy of step S is the state
at S, whatever rank or world size wrote it. So, when some rank holds no part of its own:

- candidates are the steps any rank's node holds in a slot, newer than the newest step every
  rank holds as a part (local or disk): those the exact rule would have used already win;
- for the newest candidate every rank checks its slots of that step (the slot checksum) and
  hashes their *content* (the skeleton and tensor bytes, not the padding between them); the
  step is taken only when every whole copy has the same content: two different states both
  called step S (a node that sat out a stretch of the job, holding another history) make the
  step ambiguous, and the next older candidate is tried;
- ranks whose node holds that content load it from their agent's memory; the others receive
  it from the lowest such rank over the default group (a worker cannot read another agent's
  memfd). Every rank ends with the same bytes: one step, never a mix.

Sharded state (DTensors) cannot be served this way: a shard belongs to one rank of one mesh;
DCP's resharding from the disk tier is what restores it at another world size
(:func:`sharded_note` says so in one line).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from . import codec
from .local import READY, SLOTS, Region, SlotMeta

Gather = Callable[[Any], list[Any]]


@dataclass(frozen=True)
class FromCopy:
    """What this rank restored: its slot (or ``-1``: ``raw`` in a private buffer) and whence."""

    step: int
    slot: int
    length: int
    raw: Optional[bytearray]
    words: str


def content_digest(data: memoryview) -> int:
    """XXH3-64 of a serialized state's meaningful bytes: the skeleton and each tensor's bytes.
    Two slots holding the same state give the same digest whatever their padding holds."""
    import io

    import torch
    import xxhash

    (n,) = codec.U64.unpack_from(data, 0)
    skeleton = data[codec.U64.size:codec.U64.size + n]
    h = xxhash.xxh3_64()
    h.update(skeleton)
    meta = torch.load(io.BytesIO(bytes(skeleton)), weights_only=True)["tensors"]
    base = (codec.U64.size + n + codec.ALIGN - 1) // codec.ALIGN * codec.ALIGN
    for _, _, off, nbytes in meta:
        h.update(data[base + off:base + off + nbytes])
    return int(h.intdigest())


def candidates(parts: list[list[int]], slots: list[list[int]], own: list[bool]) -> list[int]:
    """Steps worth restoring from a copy, newest first (pure). ``parts``: every rank's own steps
    (local and disk); ``slots``: every step its node's memory holds, whoever wrote it; ``own``:
    whether it holds a slot of its own rank and world. Only when some rank holds none, and only
    steps newer than the newest every rank holds as a part (the exact rule serves those)."""
    if all(own):
        return []
    floor = _newest_common(parts)
    held = {s for lst in slots for s in lst}
    return sorted((s for s in held if floor is None or s > floor), reverse=True)


def _newest_common(lists: list[list[int]]) -> Optional[int]:
    common = set(lists[0]).intersection(*map(set, lists[1:])) if lists else set()
    return max(common) if common else None


def ready_any(region: Region) -> list[SlotMeta]:
    """This node's published slots of this local rank, whoever wrote them, newest first."""
    out = [m for m in (region.meta(i) for i in range(SLOTS))
           if m.state == READY and 0 < m.length <= region.slot_size]
    return sorted(out, key=lambda m: m.seq, reverse=True)


def pick(digests: list[Optional[str]]) -> tuple[Optional[str], list[int]]:
    """The one content every whole copy has, and the ranks holding it (pure); ``(None, [])``
    when no rank holds a whole copy or two copies differ."""
    held = {d for d in digests if d is not None}
    if len(held) != 1:
        return None, []
    (d,) = held
    return d, [r for r, x in enumerate(digests) if x == d]


def sharded_note(region: Region, rank: int, world: int, floor: Optional[int]) -> Optional[str]:
    """One line when this node's memory holds a newer step at another rank or world size that
    sharded state cannot use; None otherwise."""
    other = [m for m in ready_any(region) if (m.rank, m.world) != (rank, world)
             and (floor is None or m.step > floor)]
    if not other:
        return None
    m = max(other, key=lambda m: m.step)
    return (f"rank {rank}: local memory holds step {m.step} of rank {m.rank} in a world of {m.world}, "
            f"but the state is sharded (DTensor) and a shard restores from memory only at the same "
            f"rank and world size ({world} now); add the disk tier (--snapshot local,disk "
            "--snapshot-dir DIR): DCP reshards it onto this world")


def restore(region: Region, rank: int, world: int, parts: list[int], *, replicated: bool,
            gather: Gather, say: Callable[[str], None]) -> Optional[FromCopy]:
    """Restore a step from any whole copy (module docstring); None to leave it to the exact
    rule. Collective: every rank calls it with the same ``replicated``."""
    held = ready_any(region)
    lists = gather({"parts": sorted(parts), "slots": sorted({m.step for m in held}),
                    "own": any((m.rank, m.world) == (rank, world) for m in held)})
    steps = candidates([x["parts"] for x in lists], [x["slots"] for x in lists],
                       [x["own"] for x in lists])
    if not steps:
        return None
    if not replicated:
        line = sharded_note(region, rank, world, _newest_common([x["parts"] for x in lists]))
        if line is not None:
            say(line)
        return None
    for step in steps:
        mine = _whole_copy(region, rank, step, say)
        digest, holders = pick(gather(None if mine is None else f"{mine[1]:016x}"))
        if digest is None:
            if rank == 0:
                say(f"no single whole copy of step {step} in memory (the nodes' copies differ, or "
                    "every copy is torn); trying an older step")
            continue
        return _take(region, rank, world, step, mine if rank in holders else None, holders)
    return None


def _whole_copy(region: Region, rank: int, step: int, say: Callable[[str], None]
                ) -> Optional[tuple[SlotMeta, int]]:
    """This node's whole slot of ``step`` (checksum checked) and its content digest."""
    for m in ready_any(region):
        if m.step != step:
            continue
        why = region.verify(m)
        if why is not None:
            say(f"rank {rank}'s local copy of step {step} (rank {m.rank} of {m.world}) is torn ({why})")
            continue
        return m, content_digest(region.data(m.index)[:m.length])
    return None


def _take(region: Region, rank: int, world: int, step: int, mine: Optional[tuple[SlotMeta, int]],
          holders: list[int]) -> FromCopy:
    """Load the agreed copy: from this node's slot, else broadcast from the lowest holder."""
    import torch
    import torch.distributed as dist

    if mine is not None:
        m = mine[0]
        region.make_active(m.index)
        if (m.rank, m.world) != (rank, world):  # it is this rank's own part from now on
            region.publish(m.index, step, m.length, rank, world)
            region.seal(m.index)
        words = "local memory" + ("" if (m.rank, m.world) == (rank, world)
                                  else f" (rank {m.rank}'s copy, world of {m.world})")
    src = holders[0]
    if len(holders) < world:  # some rank holds no copy: the lowest holder sends it
        size = torch.tensor([mine[0].length if mine is not None and rank == src else 0])
        dist.broadcast(size, src)
        n = int(size[0])
        if rank == src:
            assert mine is not None
            buf = torch.frombuffer(region.data(mine[0].index), dtype=torch.uint8, count=n)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, src)
        if mine is None:
            raw = bytearray(buf.numpy().tobytes())
            del buf
            words = f"rank {src}'s local memory (over the process group)"
            try:
                i = region.adopt(step, memoryview(raw), rank, world, origin=words)
            except Exception:  # too big for this node's slot: keep it privately
                return FromCopy(step, -1, len(raw), raw, words)
            return FromCopy(step, i, len(raw), None, words)
        del buf
    assert mine is not None
    return FromCopy(step, mine[0].index, mine[0].length, None, words)

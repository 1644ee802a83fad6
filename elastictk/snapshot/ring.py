"""Who holds whose replicas, and what a node fetches at restore (pure functions, no I/O).

The round's nodes form a ring in group-rank order; node ``p`` sends its parts to the next
``replicas`` nodes after it (never to itself), so every node holds the parts of the
``replicas`` nodes before it and losing any ``replicas`` nodes at once loses no part.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence, TypeVar

H = TypeVar("H")  # whatever names a holder


def ring_targets(position: int, count: int, replicas: int) -> list[int]:
    """The positions (0..count-1) of the nodes that hold replicas of node ``position``'s parts."""
    if not 0 <= position < count:
        raise ValueError(f"position {position} is not in a ring of {count}")
    return [(position + k) % count for k in range(1, min(max(replicas, 0), count - 1) + 1)]


def to_fetch(local: Iterable[int], offers: Mapping[int, Sequence[H]], keep: int = 2
             ) -> list[tuple[int, H]]:
    """Which ``(step, holder)`` to fetch for one rank: of the newest ``keep`` steps held here or
    offered by a peer, those not held here, oldest first (the newest lands last, in the slot a
    restore reads first), each from the first holder that offers it."""
    have = set(local)
    wanted = sorted(have | {s for s, who in offers.items() if who}, reverse=True)[:keep]
    return [(s, offers[s][0]) for s in sorted(wanted) if s not in have]

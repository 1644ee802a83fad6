"""Who holds whose replicas, and what a node fetches at restore (pure functions, no I/O).

The round's nodes form a ring in group-rank order; node ``p`` sends its parts to the next
``replicas`` nodes after it (never to itself), so every node holds the parts of the
``replicas`` nodes before it and losing any ``replicas`` nodes at once loses no part.

At a round's start each agent learns, from every member's ``index``, which steps each rank's
holder keeps in its local slots and which replicas any member holds, and agrees before it
fetches (:func:`agreed_fetch`): the step to restore is the newest step every rank of the world
has somewhere, and a node fetches that step for those of its ranks that lack it locally.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence, TypeVar

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


def common_step(world: int, local: Mapping[int, Iterable[int]],
                offers: Mapping[int, Mapping[int, Sequence[H]]]) -> Optional[int]:
    """The newest step every rank ``0..world-1`` has somewhere: in its holder's local slots
    (``local``: rank -> steps) or as a replica any member holds (``offers``: rank -> step ->
    holders); None when some rank has none in common with the others."""
    if world < 1:
        return None
    common: Optional[set[int]] = None
    for rank in range(world):
        have = set(local.get(rank, ())) | {s for s, who in offers.get(rank, {}).items() if who}
        common = have if common is None else common & have
        if not common:
            return None
    return max(common) if common else None


def agreed_fetch(world: int, local: Mapping[int, Iterable[int]],
                 offers: Mapping[int, Mapping[int, Sequence[H]]], mine: Iterable[int]
                 ) -> tuple[Optional[int], dict[int, list[tuple[int, H]]]]:
    """The step the ranks will agree on and, for each of this node's ranks ``mine``, which
    ``(step, holder)`` to fetch, oldest first.

    ``local`` holds every rank's local steps (this node's ranks' own slots included); ``offers``
    every replica any member holds (this node's own included). With T = :func:`common_step`: a
    rank that holds T locally fetches nothing; one that does not fetches T from its first holder,
    and, when it holds nothing locally (a replacement node), its newest offered step too. So a
    rank fetches at most one part into a region that holds any (adopting it evicts the older
    slot, never the newest), and after the fetches every rank holds T. With no common step,
    :func:`to_fetch`: the newest two steps."""
    t = common_step(world, local, offers)
    plan: dict[int, list[tuple[int, H]]] = {}
    for rank in mine:
        have = set(local.get(rank, ()))
        offered = {s: who for s, who in offers.get(rank, {}).items() if who}
        if t is None:
            plan[rank] = to_fetch(have, offered)
            continue
        want = [] if t in have else [t]
        if not have and offered and max(offered) > t:
            want.append(max(offered))
        plan[rank] = [(s, offered[s][0]) for s in sorted(want)]
    return t, plan

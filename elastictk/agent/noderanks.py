"""Each member's worker rank range (torchrun's assignment), with this node's own taken from its
round assignment.

Apart from :mod:`elastictk.agent.coordination` (what agents agree on through the store)
because it reads nothing from the store: the closer of the round computed every member's
range and put each in that member's assignment, so a node starting its workers needs no member
list (O(1) bytes per join at any job size); only a look at another member's range, which
in-place recovery makes, reads the list (once, then kept).
"""
from __future__ import annotations

from typing import Any

from ..rendezvous import RoundInfo
from ..supervisor.env import NodeRanks, assign_ranks


class _Ranges(list[NodeRanks]):
    """Every member's rank range, of which this node's own (``[info.rank]``) comes with its
    assignment: only a look at another member's reads the member list (once, then kept)."""

    def __init__(self, info: RoundInfo, role: str, nproc: int, mine: NodeRanks) -> None:
        super().__init__()
        self._info, self._role, self._nproc, self._mine = info, role, nproc, mine
        self._all: list[NodeRanks] | None = None

    def _whole(self) -> list[NodeRanks]:
        if self._all is None:
            self._all = _from_members(self._info, self._role, self._nproc)
        return self._all

    def __len__(self) -> int:
        return self._info.world_size

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, int) and i in (self._info.rank, self._info.rank - self._info.world_size):
            return self._mine
        return self._whole()[i]

    def __iter__(self) -> Any:
        return iter(self._whole())

    def __eq__(self, other: object) -> bool:
        return list(self._whole()) == other

    def __repr__(self) -> str:
        return f"_Ranges(rank {self._info.rank}: {self._mine})"


def _from_members(info: RoundInfo, role: str, nproc: int) -> list[NodeRanks]:
    members = sorted(info.members, key=lambda m: m.rank)
    return assign_ranks([(str(m.meta.get("role", role)), int(m.meta.get("nproc", nproc))) for m in members])


def node_ranges(info: RoundInfo, role: str, nproc: int) -> list[NodeRanks]:
    """Every member's rank range, in group-rank order (torchrun's assignment), from the roles
    and worker counts in the members' records (``role`` and ``nproc`` where one has none).

    This node's own range comes with its assignment (the closer computed every member's), so
    ``node_ranges(...)[info.rank]`` reads nothing: a joiner's cost stays O(1). Other entries
    read the member list on first use (in-place recovery maps every member's ranks)."""
    if info.ranks is not None:
        return _Ranges(info, role, nproc, NodeRanks(*info.ranks))
    return _from_members(info, role, nproc)

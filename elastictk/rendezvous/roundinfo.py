"""What a node holds after a join: its place in a closed round (:class:`RoundInfo`).

Apart from :mod:`elastictk.rendezvous.handler` (how a node joins) because the agent, the
watches and the in-place host hold a round without joining one.
"""
from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

from ..store import Store
from .records import Member


@dataclass(frozen=True)
class RoundInfo:
    """This node's place in a closed round.

    A join reads only this node's own assignment (O(1) in the round's size): rank, world size,
    rank 0's meta (``master``) and the ring successors whose heartbeats it watches. The member
    list is read from the round's result on first use of :attr:`members` (once, then kept),
    so only those that need every member's record pay for it.
    """

    round: int
    rank: int
    world_size: int
    store_prefix: str
    store: Store = field(repr=False, compare=False)
    master: dict[str, Any] = field(default_factory=dict, compare=False)
    ring: tuple[str, ...] = field(default=(), compare=False)
    #: This node's worker ranks from its assignment (first global rank, global world, first
    #: role rank, role world); None when the closer could not compute them.
    ranks: tuple[int, int, int, int] | None = field(default=None, compare=False)
    load_members: Callable[[], tuple[Member, ...]] | None = field(default=None, repr=False, compare=False)

    @cached_property
    def members(self) -> tuple[Member, ...]:
        if self.load_members is None:
            return ()
        return self.load_members()

    @property
    def peers(self) -> tuple[Member, ...]:
        return self.members


def default_node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"

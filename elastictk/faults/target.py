"""Which part of the job a fault hits: ``rank:<global rank>``, ``node:<node rank>`` or ``store``.

A node is an agent and its local workers (its ``GROUP_RANK``); a worker fault aimed at a node
hits every worker on it at once, ``kill-agent`` hits the agent itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .kinds import NODE, RANK, STORE, FaultKindError


@dataclass(frozen=True, order=True)
class Target:
    kind: str  # "rank" | "node" | "store"
    index: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind == STORE:
            if self.index is not None:
                raise FaultKindError("target 'store' takes no number; write 'store'")
        elif self.kind in (RANK, NODE):
            if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
                raise FaultKindError(f"target {self.kind} needs a number >= 0, e.g. "
                                     f"'{self.kind}:0', got {self.index!r}")
        else:
            raise FaultKindError(f"unknown target {self.kind!r}; write 'rank:<n>', 'node:<n>' "
                                 "or 'store'")

    @classmethod
    def parse(cls, text: object) -> Target:
        """``"rank:3"``, ``"node:0"`` or ``"store"``; anything else raises one line."""
        if isinstance(text, Target):
            return text
        if not isinstance(text, str):
            raise FaultKindError(f"target {text!r} must be a string: 'rank:<n>', 'node:<n>' or "
                                 "'store'")
        kind, sep, raw = text.strip().partition(":")
        if kind == STORE and not sep:
            return cls(STORE)
        if kind not in (RANK, NODE) or not sep:
            raise FaultKindError(f"target {text!r} must be 'rank:<n>', 'node:<n>' or 'store'")
        try:
            index = int(raw)
        except ValueError:
            raise FaultKindError(f"target {text!r}: {raw!r} is not a number; write e.g. "
                                 f"'{kind}:0'") from None
        return cls(kind, index)

    @classmethod
    def rank(cls, n: int) -> Target:
        return cls(RANK, n)

    @classmethod
    def node(cls, n: int) -> Target:
        return cls(NODE, n)

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    def hits(self, rank: int, node: Optional[int]) -> bool:
        """Whether a worker with this global rank on this node is hit."""
        if self.kind == RANK:
            return self.index == rank
        return self.kind == NODE and node is not None and self.index == node

"""The rendezvous decisions as pure functions over what a node has read from the store.

Nothing here touches a store, a clock or a thread: time arrives as a number, the store's
contents as plain data. That is what lets the hypothesis state machine drive thousands of joins,
crashes and late arrivals through the exact code the handler runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from .config import RendezvousConfig
from .records import Member, RoundResult


@dataclass(frozen=True)
class Arrival:
    """A node that bumped the round's arrival counter and wrote its slot."""

    seq: int
    node_id: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundView:
    """What the closer of round ``round`` knows at local monotonic time ``now``."""

    round: int
    arrivals: tuple[Arrival, ...]
    previous: RoundResult | None
    dead: frozenset[str]
    now: float
    opened_at: float
    min_reached_at: float | None = None


@dataclass(frozen=True)
class Close:
    members: tuple[Member, ...]


@dataclass(frozen=True)
class Wait:
    """Wait until slot ``wake_seq`` is written or until ``until`` (local monotonic)."""

    until: float
    wake_seq: int
    min_reached_at: float | None


@dataclass(frozen=True)
class Hold:
    """The previous round runs full and whole: every arrival so far is a spare. Wait (with no
    deadline: a spare may wait as long as the job runs) until slot ``wake_seq`` is written or a
    member is seen dead, then decide again."""

    wake_seq: int


@dataclass(frozen=True)
class Fail:
    reason: str


Decision = Close | Wait | Hold | Fail


def round_to_join(latest: int, latest_closed: bool) -> int:
    """A node joins the open round, or opens the next one when the newest is already closed."""
    if latest <= 0:
        return 1
    return latest + 1 if latest_closed else latest


def eligible(arrivals: Iterable[Arrival], dead: frozenset[str]) -> list[Arrival]:
    """Arrivals in seq order, each node once, without the nodes known to be gone."""
    seen: set[str] = set()
    out = []
    for a in sorted(arrivals, key=lambda a: a.seq):
        if a.node_id in seen or a.node_id in dead:
            continue
        seen.add(a.node_id)
        out.append(a)
    return out


def closer(arrivals: Iterable[Arrival], dead: frozenset[str]) -> str | None:
    """The node expected to close the round: the earliest arrival still alive."""
    live = eligible(arrivals, dead)
    return live[0].node_id if live else None


def assign_ranks(chosen: Sequence[Arrival], previous: RoundResult | None) -> tuple[Member, ...]:
    """Ranks 0..n-1; a survivor keeps its old rank when it is still below n.

    Keeping ranks means a surviving node's workers keep their data shards and checkpoint
    paths across a membership change; the others fill the holes in arrival order.
    """
    n = len(chosen)
    old = {m.node_id: m.rank for m in previous.members} if previous else {}
    ranks: dict[str, int] = {}
    taken: set[int] = set()
    for a in chosen:
        r = old.get(a.node_id)
        if r is not None and r < n and r not in taken:
            ranks[a.node_id] = r
            taken.add(r)
    free = iter(r for r in range(n) if r not in taken)
    for a in chosen:
        if a.node_id not in ranks:
            ranks[a.node_id] = next(free)
    return tuple(
        sorted((Member(a.node_id, ranks[a.node_id], a.meta) for a in chosen), key=lambda m: m.rank)
    )


def choose(live: Sequence[Arrival], previous: RoundResult | None, max_nodes: int) -> list[Arrival]:
    """Up to ``max_nodes`` arrivals: the previous round's members first, then by arrival."""
    prev = {m.node_id for m in previous.members} if previous else set()
    ordered = [a for a in live if a.node_id in prev] + [a for a in live if a.node_id not in prev]
    chosen = {a.node_id for a in ordered[:max_nodes]}
    return [a for a in live if a.node_id in chosen]


def split(live: Sequence[Arrival], previous: RoundResult | None,
          max_nodes: int) -> tuple[list[Arrival], list[Arrival]]:
    """The round's members and its spares, each in arrival order: a node past ``max_nodes``
    (after the previous round's members, who keep their places) waits as a spare, and the
    spares are taken in the order they arrived when a place opens."""
    chosen = {a.node_id for a in choose(live, previous, max_nodes)}
    return [a for a in live if a.node_id in chosen], [a for a in live if a.node_id not in chosen]


def held(view: RoundView, cfg: RendezvousConfig) -> bool:
    """Whether the previous round still runs full: all of its ``max_nodes`` members alive and
    none of them here. Whoever arrived is then a spare, and closing (or even counting down to
    a close) would re-form a full job for nothing; the round opens for real once a member is
    lost, leaves or comes back to re-form."""
    prev = view.previous
    if prev is None or prev.shutdown is not None or len(prev.members) < cfg.max_nodes:
        return False
    here = {a.node_id for a in view.arrivals}
    return not any(m.node_id in view.dead or m.node_id in here for m in prev.members)


def pending_previous(view: RoundView) -> list[str]:
    """Members of the previous round that are alive but have not arrived yet."""
    if view.previous is None:
        return []
    here = {a.node_id for a in view.arrivals}
    return [m.node_id for m in view.previous.members if m.node_id not in here and m.node_id not in view.dead]


def decide(view: RoundView, cfg: RendezvousConfig) -> Decision:
    """Close the round now, wait for more arrivals (and until when), or give up.

    - A round never closes below ``min_nodes``; it closes at once with ``max_nodes``.
    - Between the two it stays open for ``last_call`` seconds after ``min_nodes`` were in.
    - Live members of the previous round are waited for (bounded), so a node that is merely
      slower to stop its workers is not displaced by a newcomer.
    - With fewer than ``min_nodes`` after ``join_timeout``, the round fails.
    - While the previous round runs full and whole, the arrivals are spares: :class:`Hold`
      (the handler starts the round's clocks afresh once the hold ends).
    """
    last_seq = max((a.seq for a in view.arrivals), default=0)
    if held(view, cfg):
        return Hold(last_seq + 1)
    live = eligible(view.arrivals, view.dead)
    pending = pending_previous(view)
    # Wake when enough new arrivals could have come to change the answer, not on each one.
    target = cfg.min_nodes if len(live) < cfg.min_nodes else cfg.max_nodes
    next_seq = last_seq + max(1, target - len(live))
    join_deadline = view.opened_at + cfg.join_timeout
    if len(live) < cfg.min_nodes:
        if view.now >= join_deadline:
            if len(live) <= 1:  # another --rdzv-id (or endpoint) is a job of its own, unseen here
                return Fail(
                    f"round {view.round}: no other node joined rdzv-id {cfg.job_id!r} within the "
                    f"join timeout of {cfg.join_timeout:g}s (at least {cfg.min_nodes} needed); give "
                    "every node the same --rdzv-id and --rdzv-endpoint, start the others, or lower "
                    "--nnodes MIN"
                )
            return Fail(
                f"round {view.round}: only {len(live)} of at least {cfg.min_nodes} node(s) joined "
                f"within the join timeout of {cfg.join_timeout:g}s; start more nodes or lower "
                "--nnodes MIN (or raise join_timeout in --rdzv-conf)"
            )
        return Wait(join_deadline, next_seq, None)
    min_at = view.min_reached_at if view.min_reached_at is not None else view.now
    prev_deadline = view.opened_at + cfg.last_call + cfg.heartbeat_timeout
    if pending and view.now < prev_deadline:
        return Wait(prev_deadline, next_seq, min_at)
    if len(live) >= cfg.max_nodes or view.now >= min_at + cfg.last_call:
        return Close(assign_ranks(split(live, view.previous, cfg.max_nodes)[0], view.previous))
    return Wait(min_at + cfg.last_call, next_seq, min_at)

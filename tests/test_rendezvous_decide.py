"""The rendezvous decisions, driven by hypothesis through joins, crashes, leaves and time.

The machine plays the protocol the handler runs (arrival counter, one slot per arrival, the
earliest live arrival decides, the result written once) with a dict for the store, so every
decision the real handler can take is exercised here without sockets or threads.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from elastictk.rendezvous.config import RendezvousConfig
from elastictk.rendezvous.decide import (
    Arrival, Close, Fail, Hold, RoundView, Wait, assign_ranks, closer, decide, eligible, held, round_to_join, split,
)
from elastictk.rendezvous.records import Member, RoundResult

NODES = [f"n{i}" for i in range(7)]


class RendezvousProtocol(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cfg: RendezvousConfig | None = None
        self.now = 0.0
        self.latest = 0
        self.results: dict[int, RoundResult] = {}
        self.arrivals: dict[int, list[Arrival]] = {}
        self.opened_at: dict[int, float] = {}
        self.min_at: dict[int, float | None] = {}
        self.dead: set[str] = set()
        self.where: dict[str, int] = {}  # node -> round it waits in
        self.floor: dict[str, int] = {}
        self.seen_latest = [0]

    @precondition(lambda self: self.cfg is None)
    @rule(lo=st.integers(1, 4), extra=st.integers(0, 3), last_call=st.sampled_from([0.0, 1.0, 5.0]))
    def configure(self, lo: int, extra: int, last_call: float) -> None:
        self.cfg = RendezvousConfig("job", lo, lo + extra, last_call=last_call, join_timeout=50.0,
                                    heartbeat_interval=1.0, heartbeat_timeout=3.0)

    def _join(self, node: str) -> None:
        closed = self.latest in self.results
        n = max(round_to_join(self.latest, closed), self.floor.get(node, 1))
        if n > self.latest:
            self.latest = n
            self.opened_at.setdefault(n, self.now)
        arr = self.arrivals.setdefault(n, [])
        arr.append(Arrival(len(arr) + 1, node, {"host": node}))
        self.where[node] = n

    @precondition(lambda self: self.cfg is not None)
    @rule(node=st.sampled_from(NODES))
    def join(self, node: str) -> None:
        if node in self.dead or node in self.where:
            return
        self._join(node)

    @precondition(lambda self: self.cfg is not None)
    @rule(node=st.sampled_from(NODES))
    def crash(self, node: str) -> None:
        self.dead.add(node)
        self.where.pop(node, None)

    @precondition(lambda self: self.cfg is not None)
    @rule(dt=st.sampled_from([0.1, 0.5, 2.0, 10.0, 60.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @precondition(lambda self: self.cfg is not None and self.latest > 0)
    @rule(members_rejoin=st.booleans())
    def closer_acts(self, members_rejoin: bool) -> None:
        assert self.cfg is not None
        n = self.latest
        if n in self.results:
            if members_rejoin:  # a membership change: every live member of n re-rendezvouses
                for m in self.results[n].members:
                    if m.node_id not in self.dead and m.node_id not in self.where:
                        self._join(m.node_id)
            return
        arrivals = tuple(self.arrivals.get(n, []))
        dead = frozenset(self.dead)
        who = closer(arrivals, dead)
        if who is None:
            return
        view = RoundView(n, arrivals, self.results.get(n - 1), dead, self.now,
                         self.opened_at[n], self.min_at.get(n))
        decision = decide(view, self.cfg)
        if isinstance(decision, Close):
            result = RoundResult(n, decision.members)
            # compare-and-set: the first close wins; the model never sees a second one
            assert n not in self.results
            if len(result.members) < self.cfg.max_nodes and self.cfg.last_call > 0:
                min_at = self.min_at.get(n)
                assert min_at is not None and self.now >= min_at + self.cfg.last_call, \
                    "below max, a round stays open for the whole last-call window"
            self.results[n] = result
            self.check_result(n, view, result)
            for a in arrivals:
                self.where.pop(a.node_id, None)
                if result.rank_of(a.node_id) is None and a.node_id not in self.dead:
                    self.floor[a.node_id] = n + 1
                    self._join(a.node_id)  # left out: waits for the next round
        elif isinstance(decision, Hold):  # the previous round runs full and whole: spares wait
            assert held(view, self.cfg) and len(self.results[n - 1].members) == self.cfg.max_nodes
            assert not {m.node_id for m in self.results[n - 1].members} & (dead | {a.node_id for a in arrivals})
            self.opened_at[n], self.min_at[n] = self.now, None  # the handler's clocks start afresh
        elif isinstance(decision, Wait):
            self.min_at[n] = decision.min_reached_at
            assert decision.until > self.now or decision.until >= self.opened_at[n]
        else:
            assert isinstance(decision, Fail)
            assert self.now >= self.opened_at[n] + self.cfg.join_timeout
            assert "join timeout" in decision.reason and "\n" not in decision.reason

    def check_result(self, n: int, view: RoundView, result: RoundResult) -> None:
        assert self.cfg is not None
        ranks = sorted(m.rank for m in result.members)
        assert ranks == list(range(len(result.members))), "ranks unique and contiguous"
        assert self.cfg.min_nodes <= len(result.members) <= self.cfg.max_nodes
        ids = [m.node_id for m in result.members]
        assert len(set(ids)) == len(ids)
        assert not set(ids) & view.dead, "no known-dead node is a member"
        assert set(ids) <= {a.node_id for a in view.arrivals}, "only arrivals are members"
        prev = view.previous
        # Spares are taken in arrival order (a dead one skipped): the newcomers in the round are
        # the earliest live arrivals that were not members of the previous round.
        old_ids = {m.node_id for m in prev.members} if prev else set()
        newcomers = [a.node_id for a in eligible(view.arrivals, view.dead) if a.node_id not in old_ids]
        taken = [x for x in newcomers if x in ids]
        assert taken == newcomers[:len(taken)], "spares join in arrival order"
        if prev is not None:
            for m in result.members:
                old = prev.rank_of(m.node_id)
                if old is not None and old < len(result.members):
                    assert m.rank == old, "a survivor keeps its rank where it can"

    @invariant()
    def rounds_only_grow(self) -> None:
        assert self.latest >= self.seen_latest[-1]
        self.seen_latest.append(self.latest)
        assert all(k <= self.latest for k in self.results)

    @invariant()
    def closes_at_max_without_waiting(self) -> None:
        if self.cfg is None or self.latest in self.results or self.latest == 0:
            return
        n = self.latest
        arrivals = tuple(self.arrivals.get(n, []))
        live = {a.node_id for a in arrivals} - self.dead
        prev = self.results.get(n - 1)
        pending = [m for m in (prev.members if prev else ()) if m.node_id not in self.dead and m.node_id not in live]
        if len(live) >= self.cfg.max_nodes and not pending:
            view = RoundView(n, arrivals, prev, frozenset(self.dead), self.now, self.opened_at[n], self.min_at.get(n))
            assert isinstance(decide(view, self.cfg), Close)


    @invariant()
    def full_round_holds_its_spares(self) -> None:
        """While the running round is full and whole, a newcomer never makes the next close."""
        if self.cfg is None or self.latest in self.results or self.latest < 2:
            return
        n = self.latest
        prev = self.results.get(n - 1)
        arrivals = tuple(self.arrivals.get(n, []))
        if prev is None or len(prev.members) < self.cfg.max_nodes:
            return
        here = {a.node_id for a in arrivals}
        if any(m.node_id in self.dead or m.node_id in here for m in prev.members):
            return
        view = RoundView(n, arrivals, prev, frozenset(self.dead), self.now, self.opened_at[n], self.min_at.get(n))
        assert isinstance(decide(view, self.cfg), Hold)


TestRendezvousProtocol = RendezvousProtocol.TestCase
TestRendezvousProtocol.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.lists(st.sampled_from(NODES), unique=True, min_size=1), st.lists(st.sampled_from(NODES), unique=True))
def test_assign_ranks_keeps_survivors(now_ids: list[str], before_ids: list[str]) -> None:
    prev = RoundResult(1, tuple(Member(n, r) for r, n in enumerate(before_ids))) if before_ids else None
    chosen = [Arrival(i + 1, n) for i, n in enumerate(now_ids)]
    members = assign_ranks(chosen, prev)
    assert sorted(m.rank for m in members) == list(range(len(now_ids)))
    for m in members:
        old = prev.rank_of(m.node_id) if prev else None
        if old is not None and old < len(now_ids):
            assert m.rank == old


def test_round_to_join() -> None:
    assert round_to_join(0, False) == 1
    assert round_to_join(3, False) == 3
    assert round_to_join(3, True) == 4


def test_last_call_window() -> None:
    cfg = RendezvousConfig("j", 2, 4, last_call=5.0, join_timeout=100, heartbeat_interval=1, heartbeat_timeout=3)
    two = (Arrival(1, "a"), Arrival(2, "b"))
    first = decide(RoundView(1, two, None, frozenset(), 10.0, 0.0), cfg)
    assert isinstance(first, Wait) and first.until == 15.0 and first.wake_seq == 4
    assert isinstance(decide(RoundView(1, two, None, frozenset(), 15.0, 0.0, 10.0), cfg), Close)
    four = two + (Arrival(3, "c"), Arrival(4, "d"))
    assert isinstance(decide(RoundView(1, four, None, frozenset(), 10.0, 0.0), cfg), Close)


def test_a_node_alone_at_the_join_timeout_names_its_rdzv_id() -> None:
    """A node given another --rdzv-id waits under an id of its own and cannot be seen: the
    lone node's timeout says which id nobody else joined (with two in, the count as before)."""
    cfg = RendezvousConfig("job-7", 3, 3, last_call=1.0, join_timeout=50, heartbeat_interval=1,
                           heartbeat_timeout=3)
    alone = decide(RoundView(1, (Arrival(1, "a"),), None, frozenset(), 60.0, 0.0), cfg)
    assert isinstance(alone, Fail) and "no other node joined rdzv-id 'job-7'" in alone.reason
    assert "same --rdzv-id and --rdzv-endpoint" in alone.reason and "join timeout" in alone.reason
    two = decide(RoundView(1, (Arrival(1, "a"), Arrival(2, "b")), None, frozenset(), 60.0, 0.0), cfg)
    assert isinstance(two, Fail) and "only 2 of at least 3" in two.reason and "rdzv-id" not in two.reason


def test_live_previous_members_are_waited_for_then_dropped() -> None:
    cfg = RendezvousConfig("j", 1, 2, last_call=1.0, join_timeout=100, heartbeat_interval=1, heartbeat_timeout=3)
    prev = RoundResult(1, (Member("a", 0), Member("b", 1)))
    newcomer_first = (Arrival(1, "c"), Arrival(2, "a"))
    early = decide(RoundView(2, newcomer_first, prev, frozenset(), 1.0, 0.0), cfg)
    assert isinstance(early, Wait), "b is alive and coming: it keeps its place"
    late = decide(RoundView(2, newcomer_first, prev, frozenset(), 10.0, 0.0, 1.0), cfg)
    assert isinstance(late, Close) and {m.node_id for m in late.members} == {"a", "c"}
    dead_b = decide(RoundView(2, newcomer_first, prev, frozenset({"b"}), 1.0, 0.0), cfg)
    assert isinstance(dead_b, Close) and [m.node_id for m in dead_b.members] == ["a", "c"]


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="MIN <= MAX"):
        RendezvousConfig("j", 3, 2)
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        RendezvousConfig("j", 1, 1, heartbeat_interval=2, heartbeat_timeout=1)


@given(st.lists(st.sampled_from(NODES), unique=True, min_size=1), st.lists(st.sampled_from(NODES), unique=True),
       st.sets(st.sampled_from(NODES)), st.integers(1, 5))
def test_split_members_and_spares(order: list[str], before: list[str], dead: set[str], max_nodes: int) -> None:
    """Never more than MAX members; the previous round's live members keep their places; the
    rest are spares, taken in arrival order; a dead node is neither."""
    prev = RoundResult(1, tuple(Member(n, r) for r, n in enumerate(before))) if before else None
    live = eligible([Arrival(i + 1, n) for i, n in enumerate(order)], frozenset(dead))
    members, spares = split(live, prev, max_nodes)
    assert len(members) == min(max_nodes, len(live))
    assert [a.node_id for a in members + spares if a.node_id in dead] == []
    assert sorted(a.seq for a in members + spares) == [a.seq for a in live], "each live arrival once"
    assert spares == sorted(spares, key=lambda a: a.seq), "spares wait in arrival order"
    olds = [a for a in live if a.node_id in before]
    assert {a.node_id for a in olds[:max_nodes]} <= {a.node_id for a in members}, "members keep their places"
    if len(olds) < max_nodes:  # the places left go to the earliest newcomers
        newcomers = [a for a in live if a.node_id not in before]
        assert [a for a in members if a.node_id not in before] == newcomers[:max_nodes - len(olds)]


def test_full_round_holds_a_spare_until_a_member_is_lost() -> None:
    cfg = RendezvousConfig("j", 2, 3, last_call=1.0, join_timeout=10, heartbeat_interval=1, heartbeat_timeout=3)
    prev = RoundResult(1, (Member("a", 0), Member("b", 1), Member("c", 2)))
    spares = (Arrival(1, "s1"), Arrival(2, "s2"))
    assert decide(RoundView(2, spares, prev, frozenset(), 1e6, 0.0), cfg) == Hold(3), "no join timeout while held"
    lost_b = spares + (Arrival(3, "a"), Arrival(4, "c"))
    closed = decide(RoundView(2, lost_b, prev, frozenset({"b"}), 1.0, 0.0), cfg)
    assert isinstance(closed, Close) and [m.node_id for m in closed.members] == ["a", "s1", "c"]
    dead_spare = decide(RoundView(2, lost_b, prev, frozenset({"b", "s1"}), 1.0, 0.0), cfg)
    assert isinstance(dead_spare, Close) and [m.node_id for m in dead_spare.members] == ["a", "s2", "c"]
    smaller = RoundResult(1, (Member("a", 0), Member("b", 1)))
    assert not isinstance(decide(RoundView(2, spares, smaller, frozenset(), 1.0, 0.0), cfg), Hold)

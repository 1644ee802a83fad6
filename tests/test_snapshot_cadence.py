"""The peer tier ships the same steps on every node and keeps what a restore needs (issue #40):
the job-wide cadence (snapshot/cadence.py), a replaced replica kept until its newer step is
whole on every node (snapshot/replicas.py), the index's local slots and the restore's agreement
before it fetches (snapshot/messages.py, ring.py, peertier.py)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterator, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.snapshot import messages
from elastictk.snapshot.cadence import (
    CADENCE_KEY, MAX_CADENCE, BadValue, RoundKeys, StepClock, covering, read_cadence, read_count, whole_key,
)
from elastictk.snapshot.codec import checksum
from elastictk.snapshot.local import EMPTY, Holder, Region
from elastictk.snapshot.peer import PeerClient
from elastictk.snapshot.peertier import PeerTier
from elastictk.snapshot.replicas import KEEP, Key, Replicas
from elastictk.snapshot.ring import agreed_fetch, common_step
from elastictk.snapshot.settings import ENV_NOTIFY

JOB, TOKEN = "cadence-test", "cadence-token"


class DictStore:
    """The part of a round store the peer tier uses, in memory; clones share the data."""

    def __init__(self, lease_liveness: bool = False, data: Optional[dict[str, bytes]] = None,
                 lock: Optional[threading.Lock] = None) -> None:
        self.lease_liveness = lease_liveness
        self.data = {} if data is None else data
        self.lock = lock or threading.Lock()
        self.calls: list[str] = []

    def try_get(self, key: str) -> bytes | None:
        with self.lock:
            self.calls.append(f"get {key}")
            return self.data.get(key)

    def set(self, key: str, value: bytes) -> None:
        with self.lock:
            self.calls.append(f"set {key}")
            self.data[key] = value

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            self.calls.append(f"add {key}")
            v = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(v).encode()
            return v

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes | None:
        with self.lock:
            self.calls.append(f"cas {key}")
            now = self.data.get(key)
            if now == expected or (now is None and not expected):
                self.data[key] = desired
                return desired
            return now

    def delete(self, key: str) -> bool:
        with self.lock:
            self.calls.append(f"delete {key}")
            return self.data.pop(key, None) is not None

    def count(self, prefix: str) -> int:
        with self.lock:
            self.calls.append(f"count {prefix}")
            return sum(1 for k in self.data if k.startswith(prefix))

    def clone(self) -> "DictStore":
        return DictStore(self.lease_liveness, self.data, self.lock)

    def close(self) -> None:
        pass


# -- the cadence ------------------------------------------------------------------------------------
@given(st.floats(0, 1e9) | st.just(float("inf")) | st.just(float("nan")), st.sampled_from([1 << i for i in range(17)]))
def test_a_slow_send_raises_the_cadence_to_the_power_of_two_that_covers_two_sends(steps: float, k: int) -> None:
    new = covering(steps, k)
    assert new >= k and new & (new - 1) == 0 and new <= MAX_CADENCE, "a power of two that never falls"
    if not steps > k / 2:
        assert new == k, "a send within half of K steps keeps K"
    elif new < MAX_CADENCE:
        assert new >= 2 * steps and (new // 2 < 2 * steps or new == k), "the smallest that covers two sends"


def test_the_cadence_examples() -> None:
    assert covering(0.1, 1) == 1  # 10 ms sends, 100 ms steps: every step, as before
    assert covering(0.6, 1) == 2
    assert covering(13.3, 1) == 32  # ~2 s sends against ~0.15 s steps
    assert covering(13.3, 32) == 32
    assert covering(20, 32) == 64


@given(st.binary(max_size=30) | st.sampled_from([b"1", b"32", b"65536", b"0", b"3", b"131072", b"-4", b" 8",
                                                b"8\n", b"1e3", b"0x10", "٣".encode()]))
def test_a_cadence_in_the_store_is_a_power_of_two_in_range_or_one_line(raw: bytes) -> None:
    try:
        k = read_cadence(raw)
    except BadValue as e:
        assert "\n" not in str(e) and len(str(e)) < 200
        return
    assert type(k) is int and 1 <= k <= MAX_CADENCE and k & (k - 1) == 0
    assert int(raw) == k and raw.isdigit()
    assert read_cadence(None) == 1


@given(st.binary(max_size=30))
def test_a_whole_step_counter_in_the_store_is_a_count_or_one_line(raw: bytes) -> None:
    try:
        n = read_count(raw)
    except BadValue as e:
        assert "\n" not in str(e) and len(str(e)) < 200
        return
    assert type(n) is int and n >= 0 and raw == str(n).encode().rjust(len(raw), b"0")


def test_raising_the_cadence_only_grows_it_and_a_bad_value_is_refused_in_one_line(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "elastictk.snapshot")
    store = DictStore()
    keys = RoundKeys(store, "a", 2)
    assert keys.cadence() == 1
    assert keys.raise_to(8) == 8 and keys.cadence() == 8
    assert keys.raise_to(4) == 8, "never lowered"
    store.data[CADENCE_KEY] = b"12"  # not a power of two: someone else's
    assert keys.cadence() is None
    assert keys.cadence() is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "the cadence key holds 12, not a power of two; ignored" in lines[0], lines
    assert keys.raise_to(16) == 16 and store.data[CADENCE_KEY] == b"16", "a bad value is replaced"


def test_concurrent_raises_leave_the_largest() -> None:
    store = DictStore()
    barrier = threading.Barrier(8)

    def raise_(k: int) -> None:
        barrier.wait()
        RoundKeys(store.clone(), f"n{k}", 8).raise_to(k)
    threads = [threading.Thread(target=raise_, args=(1 << i,)) for i in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.data[CADENCE_KEY] == b"256"


@pytest.mark.parametrize("per_node", [False, True])
def test_a_step_is_whole_once_every_node_said_so_and_old_keys_go(per_node: bool) -> None:
    store = DictStore(lease_liveness=per_node)
    a, b = RoundKeys(store.clone(), "a", 2), RoundKeys(store.clone(), "b", 2)
    a.mark_whole(32)
    assert not a.whole(32) and not b.whole(32)
    b.mark_whole(32)
    assert a.whole(32) and b.whole(32)
    a.mark_whole(64)
    b.mark_whole(64)
    assert a.whole(64)
    assert not any(k.startswith(whole_key(32)) for k in store.data), "the older step's keys were deleted"
    if per_node:
        assert not any(c.startswith("add") for c in store.calls), "etcd: one key per node, no shared counter"


def test_a_store_that_fails_is_one_line_and_nothing_known(caplog: pytest.LogCaptureFixture) -> None:
    from elastictk.store import StoreError

    class Down(DictStore):
        def _down(self, *args: Any) -> Any:
            raise StoreError("gone")
        try_get = set = add = compare_set = count = _down  # type: ignore[assignment]

    caplog.set_level(logging.WARNING, "elastictk.snapshot")
    keys = RoundKeys(Down(), "a", 2)
    assert keys.cadence() is None and keys.raise_to(8) is None and not keys.whole(8)
    keys.mark_whole(8)
    assert len([r for r in caplog.records if "did not answer" in r.getMessage()]) <= 3


def test_the_step_clock_reads_seconds_per_step() -> None:
    now = [0.0]
    c = StepClock(lambda: now[0])
    c.saw(5)
    assert c.step_seconds() is None
    for step in range(6, 12):
        now[0] += 0.25
        c.saw(step)
    assert c.step_seconds() == pytest.approx(0.25)


# -- keep until whole everywhere ------------------------------------------------------------------------
def _arrive(reps: Replicas, key: Key, size: int = 100) -> list[Key]:
    rep = reps.reserve(key, checksum(bytes(size)), size, "peer")
    return reps.keep(rep)


def test_a_replaced_replica_stays_until_its_newer_step_is_whole_on_every_node() -> None:
    whole: set[int] = set()
    reps = Replicas(10_000, hold=lambda: True)
    _arrive(reps, Key("b", 1, 2, 32))
    _arrive(reps, Key("b", 1, 2, 64))
    assert [k.step for k in reps.index()] == [32, 64], "the older one waits"
    assert reps.waiting() == {64}
    assert reps.settle(whole.__contains__) == [] and len(reps.index()) == 2, "not whole yet: both stay"
    whole.add(64)
    assert reps.settle(whole.__contains__) == [Key("b", 1, 2, 32)]
    assert [k.step for k in reps.index()] == [64] and reps.waiting() == set()


def test_never_more_than_two_per_rank_and_sender_mapped_kept_and_arriving() -> None:
    reps = Replicas(300, hold=lambda: True)
    _arrive(reps, Key("b", 1, 2, 32))
    _arrive(reps, Key("b", 1, 2, 64))  # 64 never became whole everywhere (a node skipped it)
    rep = reps.reserve(Key("b", 1, 2, 96), 0, 100, "peer")  # the third: the oldest goes first
    assert [k.step for k in reps.index()] == [64] and reps.used() == 200
    reps.keep(rep)
    assert [k.step for k in reps.index()] == [64, 96] and reps.used() <= 300
    _arrive(reps, Key("b", 0, 2, 96))  # another rank: its own two
    assert len(reps.index()) == 3 and KEEP == 2


def test_without_the_rule_a_replaced_replica_goes_at_once() -> None:
    reps = Replicas(10_000, hold=lambda: False)
    _arrive(reps, Key("b", 1, 2, 32))
    assert _arrive(reps, Key("b", 1, 2, 64)) == [Key("b", 1, 2, 32)]
    assert [k.step for k in reps.index()] == [64] and reps.waiting() == set()


def test_a_newer_part_from_the_ranks_new_owner_drops_the_old_senders_at_once() -> None:
    reps = Replicas(10_000, hold=lambda: True)
    _arrive(reps, Key("b", 1, 2, 32))
    _arrive(reps, Key("b", 1, 2, 64))
    gone = _arrive(reps, Key("spare", 1, 2, 70))
    assert {k.origin for k in gone} == {"b"} and [k.origin for k in reps.index()] == ["spare"]


# -- the index's local slots -----------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
hostile_ints = st.sampled_from([-1, -(1 << 40), 0, 1, 3, 1 << 63, 1 << 64, 1 << 100, True, False,
                                float("nan"), float("inf"), 2.0])


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    json_values,
    st.lists(st.fixed_dictionaries({"rank": json_values | hostile_ints, "world": json_values | hostile_ints,
                                    "step": json_values | hostile_ints}), max_size=5),
    st.lists(st.fixed_dictionaries({"rank": st.integers(-2, 5), "world": st.integers(-1, 6),
                                    "step": st.integers(-1, 1 << 64)}), max_size=5)))
def test_the_index_local_field_is_whole_valid_entries_or_one_line(local: Any) -> None:
    for reply in ({"ok": True, "replicas": [], "local": local}, {"ok": True, "replicas": []}):
        try:
            held = messages.index_local(reply)
        except messages.BadMessage as e:
            assert "\n" not in str(e) and len(str(e)) < 300
            continue
        if "local" not in reply or local is None:
            assert held == []
            continue
        assert isinstance(local, list) and len(held) == len(local) <= messages.MAX_LOCAL
        for h, e in zip(held, local, strict=True):
            assert type(e["rank"]) is int and type(e["world"]) is int and type(e["step"]) is int
            assert type(h.rank) is int and type(h.world) is int and type(h.step) is int
            assert 0 <= h.rank < h.world <= messages.MAX_WORLD and 0 <= h.step <= messages.MAX_STEP


def test_too_many_local_entries_are_refused() -> None:
    with pytest.raises(messages.BadMessage, match="lists 4097 slots, more than 4096"):
        messages.index_local({"ok": True, "local": [{"rank": 0, "world": 1, "step": 1}] * 4097})


# -- the restore agrees before it fetches --------------------------------------------------------------------
steps = st.integers(0, 12)


@settings(max_examples=500, deadline=None)
@given(st.integers(1, 4), st.data())
def test_the_agreed_step_is_held_by_every_rank_after_the_fetches(world: int, data: st.DataObject) -> None:
    local = {r: data.draw(st.sets(steps, max_size=2)) for r in range(world)}
    offers = {r: {s: data.draw(st.lists(st.sampled_from("abc"), min_size=1, max_size=2))
                  for s in data.draw(st.sets(steps, max_size=3))} for r in range(world)}
    mine = data.draw(st.sets(st.integers(0, world - 1), min_size=1))
    t, plan = agreed_fetch(world, local, offers, mine)
    assert t == common_step(world, local, offers)
    if t is None:
        return
    for r in range(world):
        assert t in local[r] or t in offers[r], "T is somewhere for every rank"
    for r in mine:
        slots = sorted(local[r], reverse=True)  # newest first: an adopt evicts the older slot
        newest = slots[0] if slots else None
        fetched = [s for s, _ in plan[r]]
        assert fetched == sorted(fetched) and all(holder == offers[r][s][0] for s, holder in plan[r])
        for s in fetched:
            if len(slots) == 2:
                slots.remove(min(slots))
            slots.append(s)
        assert t in slots, "T is held locally after the fetches"
        assert newest is None or newest in slots, "the newest local step is never evicted"
        assert len(fetched) <= (2 if not local[r] else 1)
    if all(t in local[r] for r in mine):
        assert not any(plan.values()), "nothing fetched when every rank holds T already"


def test_the_agreed_step_examples() -> None:
    # host 1 lost after its step 32 arrived on host 0; host 0 holds 32 (pinned) and 45; a spare
    t, plan = agreed_fetch(2, {0: {32, 45}, 1: set()}, {1: {32: ["h0"], 16: ["h0"]}}, {1})
    assert t == 32 and plan == {1: [(32, "h0")]}
    t, plan = agreed_fetch(2, {0: {32, 45}, 1: set()}, {1: {32: ["h0"]}}, {0})
    assert t == 32 and plan == {0: []}
    # a survivor whose local slots moved on to 64 fetches its own 32 back from its neighbour
    t, plan = agreed_fetch(3, {0: {64, 70}, 1: set(), 2: {64, 70}},
                           {0: {32: ["c"], 64: ["b"]}, 1: {32: ["c"]}, 2: {32: ["a"]}}, {0})
    assert t == 32 and plan == {0: [(32, "c")]}
    # no common step: the newest two, as before
    t, plan = agreed_fetch(2, {0: {40}, 1: set()}, {1: {32: ["h0"], 16: ["h0"]}}, {1})
    assert t is None and plan == {1: [(16, "h0"), (32, "h0")]}


# -- the region ----------------------------------------------------------------------------------------------
def _commit(region: Region, step: int, payload: bytes, rank: int = 0, world: int = 2) -> None:
    i = region.begin()
    region.data(i)[:len(payload)] = payload
    region.publish(i, step, len(payload), rank, world)
    region.seal(i)


def test_a_pin_on_a_slot_a_restore_gave_up_does_not_make_commits_overwrite_the_active_one() -> None:
    with Holder(1, 1 << 20) as h:
        r = Region(h.path, 0, h.region, h.memory, 1)
        try:
            _commit(r, 1, b"a" * 100)
            _commit(r, 2, b"b" * 100)
            older = next(m for m in (r.meta(0), r.meta(1)) if m.step == 1)
            assert r.pin(older)
            restored = 1 - older.index
            r.make_active(restored)  # a restore of step 2: the pinned slot is given up
            assert r.meta(older.index).state == EMPTY
            assert r.next_slot() == older.index, "the restored slot is not written over in place"
            r.unpin()
            assert r.evictable(0, 2) == older.index
            _commit(r, 3, b"c" * 100)
            assert r.evictable(0, 2) == restored, "never the newest step"
        finally:
            r.close()


# -- the agents ----------------------------------------------------------------------------------------------
class Member:
    def __init__(self, node_id: str, rank: int, meta: dict[str, object]) -> None:
        self.node_id, self.rank, self.meta = node_id, rank, meta


@pytest.fixture
def nodes() -> Iterator[tuple[list[Holder], list[PeerTier]]]:
    holders: list[Holder] = []
    tiers: list[PeerTier] = []
    try:
        yield holders, tiers
    finally:
        for t in tiers:
            t.close()
        for h in holders:
            h.close()
        assert not [t.name for t in threading.enumerate() if t.name.startswith("elastictk-replicator")]


def _node(nodes: tuple[list[Holder], list[PeerTier]], size: int = 4 << 20) -> tuple[Holder, PeerTier]:
    h = Holder(1, size)
    t = PeerTier(h, "127.0.0.1", TOKEN, JOB, 1, size)
    nodes[0].append(h)
    nodes[1].append(t)
    return h, t


def _part(step: int, rank: int, size: int = 4096) -> bytes:
    return (step * 10 + rank).to_bytes(4, "little") * (size // 4)


def test_slow_sends_raise_one_cadence_for_the_job_and_every_node_ships_the_same_steps(
        nodes: tuple[list[Holder], list[PeerTier]], caplog: pytest.LogCaptureFixture) -> None:
    """Two nodes committing every ~5 ms, their sends throttled to ~0.05 s and ~0.08 s: each
    measures its own sends, the job ships one cadence (the larger), and every replica kept after
    the raise is of a step that is a multiple of it, on both nodes."""
    caplog.set_level(logging.INFO, "elastictk.snapshot")
    store = DictStore()
    pair = [_node(nodes), _node(nodes)]
    size = 64 << 10
    pair[0][1].rate, pair[1][1].rate = size / 0.05, size / 0.08
    members = [Member(f"n{i}", i, {"addr": "127.0.0.1", **t.meta()}) for i, (_, t) in enumerate(pair)]
    for i, (_, t) in enumerate(pair):
        t.round(members, 2, f"n{i}", i, prefetch=False, store=store)
    workers = [Region(h.path, 0, h.region, h.memory, 1, notify=t.env()[ENV_NOTIFY]) for h, t in pair]
    try:
        seen: list[set[int]] = [set(), set()]
        step, deadline = 0, time.monotonic() + 120

        def settled() -> bool:
            k = read_cadence(store.data.get(CADENCE_KEY))
            return k >= 8 and all(t.cadence == k for _, t in pair) and \
                min(len({s for s in x if s > 2 * k}) for x in seen) >= 3
        while not settled():
            assert time.monotonic() < deadline, (seen, caplog.text[-2000:])
            step += 1
            for rank, w in enumerate(workers):
                _commit(w, step, _part(step, rank, size), rank)
            time.sleep(0.005)
            for i, (_, t) in enumerate(pair):
                seen[i] |= {k.step for k in t.replicas.index()}
        k = read_cadence(store.data[CADENCE_KEY])
        raised = [r.getMessage() for r in caplog.records if "the job now ships every" in r.getMessage()]
        assert 1 <= len(raised) <= 6, raised
        late = [sorted(s for s in x if s > 2 * k) for x in seen]
        assert all(s % 8 == 0 for x in late for s in x), (k, late)
        assert set(late[0]) & set(late[1]), "both nodes shipped the same steps"
        assert "torn" not in caplog.text
    finally:
        for w in workers:
            w.close()


def test_a_spare_and_a_survivor_agree_on_the_lost_nodes_replica_step(
        nodes: tuple[list[Holder], list[PeerTier]]) -> None:
    """Host 1 is lost after its step 32 arrived on host 0, while host 0's slots hold 32 (the step
    it ships now, pinned) and 45: the spare fetches 32, host 0 fetches nothing, both hold 32."""
    (h0, t0), (h2, t2) = _node(nodes), _node(nodes)
    w0 = Region(h0.path, 0, h0.region, h0.memory, 1)
    try:
        t0.round([Member("h0", 0, {"addr": "127.0.0.1", **t0.meta()}), Member("h1", 1, {})], 2, "h0", 0,
                 prefetch=False)  # the round host 1 was lost in
        _commit(w0, 32, _part(32, 0))
        _commit(w0, 45, _part(45, 0))
        for s in (16, 32):  # the lost node's replicas, the older still waiting for 32 to be whole
            rep = t0.replicas.reserve(Key("h1", 1, 2, s), checksum(_part(s, 1)), 4096, "10.0.0.2")
            rep.data()[:] = _part(s, 1)
            t0.replicas._held[rep.key] = rep
            t0.replicas._pending.discard(rep)
        members = [Member("h0", 0, {"addr": "127.0.0.1", **t0.meta()}),
                   Member("h2", 1, {"addr": "127.0.0.1", **t2.meta()})]
        t0.round(members, 2, "h0", 0, prefetch=True, store=DictStore())
        t2.round(members, 2, "h2", 1, prefetch=True, store=DictStore())
        assert sorted(m.step for m in w0.ready(0, 2)) == [32, 45], "the survivor fetched nothing"
        spare = Region(h2.path, 0, h2.region, h2.memory, 1)
        try:
            got = spare.ready(1, 2)
            assert [m.step for m in got] == [32], "the spare fetched the agreed step only"
            assert bytes(spare.data(got[0].index)[:4096]) == _part(32, 1)
            assert spare.origin(got[0].index).startswith("peer 127.0.0.1 (fetched by the agent in ")
        finally:
            spare.close()
    finally:
        w0.close()


def test_a_survivor_whose_slots_moved_on_fetches_its_own_replica_back_and_keeps_its_newest(
        nodes: tuple[list[Holder], list[PeerTier]]) -> None:
    """Three nodes, each one's parts held by the other two (``--snapshot-replicas 2``); b is lost
    while its step 64 was still on its way, so b's newest whole replica is 32. The survivors'
    slots have moved on to 64 and 70, and 32 is the newest step every rank has somewhere (b's
    and a's on c, c's on a): each survivor fetches its own 32 back into its older slot, keeping
    its newest, and the spare fetches b's."""
    (ha, ta), (hc, tc), (hs, ts) = _node(nodes), _node(nodes), _node(nodes)
    wa, wc = (Region(h.path, 0, h.region, h.memory, 1) for h in (ha, hc))
    try:
        before = [Member(n, r, {}) for r, n in enumerate("abc")]  # (no endpoints: nothing ships here)
        for t, n, r in ((ta, "a", 0), (tc, "c", 2)):  # the round b was lost in
            t.round(before, 3, n, r, prefetch=False)
        for w, rank in ((wa, 0), (wc, 2)):
            _commit(w, 64, _part(64, rank), rank, 3)
            _commit(w, 70, _part(70, rank), rank, 3)

        def hold(t: PeerTier, key: Key) -> None:
            rep = t.replicas.reserve(key, checksum(_part(key.step, key.rank)), 4096, "x")
            rep.data()[:] = _part(key.step, key.rank)
            t.replicas._pending.discard(rep)
            t.replicas._held[key] = rep
        hold(tc, Key("b", 1, 3, 32))
        hold(tc, Key("a", 0, 3, 32))
        hold(ta, Key("c", 2, 3, 32))
        members = [Member("a", 0, {"addr": "127.0.0.1", **ta.meta()}),
                   Member("s", 1, {"addr": "127.0.0.1", **ts.meta()}),
                   Member("c", 2, {"addr": "127.0.0.1", **tc.meta()})]
        for t, n, r in ((ta, "a", 0), (ts, "s", 1), (tc, "c", 2)):
            t.round(members, 3, n, r, prefetch=True)
        assert sorted(m.step for m in wa.ready(0, 3)) == [32, 70], "its own 32 back, its newest kept"
        m32 = next(m for m in wa.ready(0, 3) if m.step == 32)
        assert bytes(wa.data(m32.index)[:4096]) == _part(32, 0) and wa.verify(m32) is None
        assert wa.origin(m32.index).startswith("peer 127.0.0.1")
        assert sorted(m.step for m in wc.ready(2, 3)) == [32, 70], "c likewise, from a"
        spare = Region(hs.path, 0, hs.region, hs.memory, 1)
        try:
            assert [m.step for m in spare.ready(1, 3)] == [32]
        finally:
            spare.close()
    finally:
        wa.close()
        wc.close()


def test_the_index_lists_the_local_slots(nodes: tuple[list[Holder], list[PeerTier]]) -> None:
    h, t = _node(nodes)
    w = Region(h.path, 0, h.region, h.memory, 1)
    try:
        _commit(w, 7, b"x" * 100, 3, 4)
        i = w.begin()  # a slot being written: not listed
        w.publish(i, 8, 100, 3, 4)  # published, never checksummed: not listed either
        c = PeerClient("127.0.0.1", t.server.port, TOKEN.encode(), JOB, timeout=5)
        try:
            replicas, held = c.holdings()
        finally:
            c.close()
        assert replicas == [] and held == [messages.Held(3, 4, 7)]
    finally:
        w.close()


@pytest.mark.parametrize("rule", ["kept until whole", "dropped at once"])
def test_a_node_lost_mid_send_leaves_the_previous_step_whole_everywhere(
        nodes: tuple[list[Holder], list[PeerTier]], rule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three nodes, each one's parts on the other two (``--snapshot-replicas 2``), one round
    store. All three ship step M whole; then b's sends stall, a and c ship N = M + K to each
    other and commit on, and b is lost with its N never arrived: b's newest whole step anywhere
    is M. a's and c's slots hold N and newer, and a's M was on b and c: only because c kept a's
    M beside a's N (N was never whole on every node) is M a step every rank still has; each
    survivor fetches its own M back, keeping its newest. With the rule off (the replaced
    replica dropped at once) no step is common."""
    if rule == "dropped at once":
        monkeypatch.setattr(PeerTier, "_holding", lambda self: False)
    store = DictStore()
    size = 64 << 10
    (ha, ta), (hb, tb), (hc, tc), (hs, ts) = (_node(nodes) for _ in range(4))
    for t in (ta, tb, tc, ts):
        t.count, t.rate = 2, size / 0.03
    before = [Member(n, r, {"addr": "127.0.0.1", **t.meta()}) for r, (n, t) in enumerate(zip("abc", (ta, tb, tc)))]
    for r, (n, t) in enumerate(zip("abc", (ta, tb, tc))):
        t.round(before, 3, n, r, prefetch=False, store=store)
    workers = [Region(h.path, 0, h.region, h.memory, 1, notify=t.env()[ENV_NOTIFY])
               for h, t in ((ha, ta), (hb, tb), (hc, tc))]
    step = 0

    def commit_to(last: int) -> None:
        nonlocal step
        while step < last:
            step += 1
            for rank, w in enumerate(workers):
                _commit(w, step, _part(step, rank, size), rank, 3)
            time.sleep(0.005)

    def wait(pred: Any, what: str) -> None:
        deadline = time.monotonic() + 60
        while not pred():
            assert time.monotonic() < deadline, f"{what}: {[t.replicas.index() for t in (ta, tb, tc)]}"
            time.sleep(0.01)

    try:
        deadline = time.monotonic() + 60
        while not (tb.cadence >= 8 and ta.cadence == tb.cadence == tc.cadence
                   == read_cadence(store.data.get(CADENCE_KEY))):
            assert time.monotonic() < deadline, [t.cadence for t in (ta, tb, tc)]
            commit_to(step + 1)
        k = ta.cadence
        m = (step // k + 2) * k
        commit_to(m)
        wait(lambda: read_count(store.data.get(whole_key(m))) == 3, f"step {m} whole on every node")
        tb.rate = 1e-3  # b's next send never ends
        n = m + k
        commit_to(n)

        def has(t: PeerTier, origin: str, s: int) -> bool:
            return any((x.origin, x.step) == (origin, s) for x in t.replicas.index())
        wait(lambda: has(tc, "a", n) and has(ta, "c", n) and has(tb, "a", n) and has(tb, "c", n),
             f"a's and c's step {n} everywhere")
        assert not has(ta, "b", n) and not has(tc, "b", n)
        commit_to(n + 2)  # the job commits on: the slot that held M is written over
        if rule == "kept until whole":
            assert has(tc, "a", m) and has(ta, "c", m), "N is not whole on b's part: M stays"
        for w in workers:
            w.close()
        workers = []
        tb.close()  # b is lost, its send of N cut short
        nodes[1].remove(tb)
        after = [Member("a", 0, {"addr": "127.0.0.1", **ta.meta()}), Member("s", 1, {"addr": "127.0.0.1", **ts.meta()}),
                 Member("c", 2, {"addr": "127.0.0.1", **tc.meta()})]
        for t, name, r in ((ta, "a", 0), (ts, "s", 1), (tc, "c", 2)):
            t.round(after, 3, name, r, prefetch=True, store=DictStore())
        held = {}
        for name, h, r in (("a", ha, 0), ("s", hs, 1), ("c", hc, 2)):
            reg = Region(h.path, 0, h.region, h.memory, 1)
            try:
                held[name] = sorted(x.step for x in reg.ready(r, 3))
                for x in reg.ready(r, 3):
                    assert reg.verify(x) is None and bytes(reg.data(x.index)[:size]) == _part(x.step, r, size)
            finally:
                reg.close()
        if rule == "kept until whole":
            assert held == {"a": [m, n + 2], "s": [m], "c": [m, n + 2]}, (held, m, n)
        else:
            assert not (m in held["a"] and m in held["s"] and m in held["c"]), (held, m, n)
    finally:
        for w in workers:
            w.close()


def test_the_newest_commit_ships_once_the_job_stops_committing(nodes: tuple[list[Holder], list[PeerTier]],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """An eval, or the job's end: no seal for four steps' time (at least a second), and the newest
    commit ships whatever its step, so the peers do not stay a cadence behind while nothing
    happens."""
    caplog.set_level(logging.INFO, "elastictk.snapshot")
    store = DictStore()
    (h0, t0), (h1, t1) = _node(nodes), _node(nodes)
    size = 64 << 10
    t0.rate = t1.rate = size / 0.05
    members = [Member(f"n{i}", i, {"addr": "127.0.0.1", **t.meta()}) for i, t in enumerate((t0, t1))]
    for i, t in enumerate((t0, t1)):
        t.round(members, 2, f"n{i}", i, prefetch=False, store=store)
    workers = [Region(h.path, 0, h.region, h.memory, 1, notify=t.env()[ENV_NOTIFY]) for h, t in ((h0, t0), (h1, t1))]
    try:
        step, deadline = 0, time.monotonic() + 60
        while not (t0.cadence > 1 and t1.cadence > 1) or step % t0.cadence in (0, t0.cadence - 1):
            assert time.monotonic() < deadline, caplog.text[-2000:]
            step += 1
            for rank, w in enumerate(workers):
                _commit(w, step, _part(step, rank, size), rank)
            time.sleep(0.005)
        last = step  # not a multiple of the cadence
        while not all(any(k.step == last for k in t.replicas.index()) for t in (t0, t1)):
            assert time.monotonic() < deadline, ([t.replicas.index() for t in (t0, t1)], last, t0.cadence)
            time.sleep(0.05)
        assert "torn" not in caplog.text
    finally:
        for w in workers:
            w.close()

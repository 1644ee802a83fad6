"""A joiner starts its workers from its own assignment: the closer puts each member's worker
rank range there (``records.rank_ranges``), so ``node_ranges(info, ...)[info.rank]`` reads no
member list; and the closer learns lost nodes from an append-only log, reading only what is
new at each decision (``lostlog``), never a listing of every ``lost/`` note."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from elastictk.agent.coordination import node_ranges
from elastictk.rendezvous import RoundInfo
from elastictk.rendezvous.auth import Signer
from elastictk.rendezvous.lostlog import LostReader, log_lost
from elastictk.rendezvous.records import (
    Member, RoundResult, assignments, decode_assignment, decode_ranks, encode_note, rank_ranges,
)
from elastictk.store import FileStore
from elastictk.supervisor.env import assign_ranks

nodes = st.lists(st.tuples(st.sampled_from(["trainer", "eval", "x"]), st.integers(1, 8)), min_size=1, max_size=12)


@given(nodes)
def test_the_closers_ranges_are_torchruns(spec: list[tuple[str, int]]) -> None:
    members = [Member(f"n{i}", i, {"role": r, "nproc": p}) for i, (r, p) in enumerate(spec)]
    got = rank_ranges(members)
    want = assign_ranks(spec)
    assert got == [[w.base_global_rank, w.global_world_size, w.base_role_rank, w.role_world_size] for w in want]


def _info(result: RoundResult, node: str, signer: Signer) -> RoundInfo:
    raw = assignments(result)[node].to_json(signer, "k")
    a = decode_assignment("k", raw, signer)

    def no_list() -> tuple[Member, ...]:
        raise AssertionError("the member list was read")
    return RoundInfo(result.round, a.rank, a.world, "p", None, ranks=decode_ranks(a.extra),  # type: ignore[arg-type]
                     load_members=no_list)


@given(nodes, st.data())
def test_a_node_gets_its_ranks_without_the_member_list(spec: list[tuple[str, int]], data: st.DataObject) -> None:
    members = tuple(Member(f"n{i}", i, {"role": r, "nproc": p}) for i, (r, p) in enumerate(spec))
    result = RoundResult(3, members)
    me = data.draw(st.integers(0, len(members) - 1))
    info = _info(result, f"n{me}", Signer("tok", "job"))
    assert node_ranges(info, "trainer", 1)[info.rank] == assign_ranks(spec)[me]
    assert len(node_ranges(info, "trainer", 1)) == len(members)


def test_without_role_or_nproc_in_a_record_the_member_list_decides() -> None:
    members = (Member("a", 0, {"role": "t", "nproc": 2}), Member("b", 1, {}))
    result = RoundResult(1, members)
    assert rank_ranges(list(members)) is None
    a = assignments(result)["b"]
    assert decode_ranks(a.extra) is None
    info = RoundInfo(1, 1, 2, "p", None, load_members=lambda: members)  # type: ignore[arg-type]
    assert [r.base_global_rank for r in node_ranges(info, "t", 3)] == [0, 2]  # b: the reader's nproc


@given(st.one_of(st.none(), st.integers(), st.text(), st.lists(st.one_of(st.integers(-3, 9), st.booleans(), st.text()),
                                                               max_size=6)))
def test_malformed_ranks_in_an_assignment_are_absent(value: object) -> None:
    got = decode_ranks({"ranks": value})
    if got is not None:  # what passes is a sane range
        base, world, role_base, role_world = got
        assert 0 <= base < world and 0 <= role_base < role_world <= world


def test_the_closer_reads_only_new_entries_of_the_lost_log(tmp_path: object) -> None:
    store = FileStore(str(tmp_path))
    signer = Signer("tok", "job")
    verified = lambda k, raw: raw is not None and raw == encode_note(signer, k, by="x")  # noqa: E731
    for node in ("a", "b", "forged"):
        if node != "forged":
            store.set(f"lost/{node}", encode_note(signer, f"lost/{node}", by="x"))
        else:
            store.set("lost/forged", b"not sealed")
        log_lost(store, node)
    reader = LostReader()
    assert reader.read(store, verified) == {"a", "b"}
    reads: list[str] = []
    real = store.multi_get
    store.multi_get = lambda keys: reads.extend(keys) or real(keys)  # type: ignore[method-assign, func-returns-value]
    assert reader.read(store, verified) == {"a", "b"}
    assert reads == [], "nothing new in the log: only its counter is read"
    store.set("lost/c", encode_note(signer, "lost/c", by="x"))
    log_lost(store, "c")
    assert reader.read(store, verified) == {"a", "b", "c"}
    assert reads == ["lostlog/4", "lost/c"]
    store.close()


def test_on_etcd_the_lost_log_is_one_key_per_node_and_no_counter(etcd_server: object) -> None:
    """Hundreds of nodes marking neighbours lost at once raced one compare-and-set counter on
    etcd; the log there is a key per lost node, ordered by its create revision: one write each,
    no `add`, and a reader reads only what was created since its last read."""
    import threading
    import uuid

    from elastictk.store import EtcdStore, PrefixStore

    raw = EtcdStore(etcd_server.endpoint, prefix=f"/lostlog-{uuid.uuid4().hex}/", timeout=20)  # type: ignore[attr-defined]
    store = PrefixStore("rdzv/j", raw)
    calls: list[str] = []
    for name in ("add", "compare_set", "set"):
        real = getattr(raw, name)
        setattr(raw, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    signer = Signer("tok", "job")
    verified = lambda k, v: v is not None and v == encode_note(signer, k, by="x")  # noqa: E731
    try:
        nodes = [f"n{i}" for i in range(32)]
        for n in nodes:
            store.set(f"lost/{n}", encode_note(signer, f"lost/{n}", by="x"))
        calls.clear()
        threads = [threading.Thread(target=log_lost, args=(store, n)) for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert calls == ["set"] * 32, f"not one plain write per mark: {sorted(set(calls))} x {len(calls)}"
        reader = LostReader()
        assert reader.read(store, verified) == set(nodes)
        store.set("lost/late", encode_note(signer, "lost/late", by="x"))
        log_lost(store, "late")
        got: list[list[str]] = []
        multi_get = raw.multi_get
        raw.multi_get = lambda keys: got.append(list(keys)) or multi_get(keys)  # type: ignore[method-assign, func-returns-value]
        assert reader.read(store, verified) == set(nodes) | {"late"}
        assert got == [["rdzv/j/lost/late"]], got  # only the new entry's note was read
    finally:
        raw.close()

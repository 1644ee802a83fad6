"""ElasticSampler and elastictk.data.DataLoader in one process: the exactly-once properties over
any dataset size, batch size, sequence of world sizes and stop points; the position a commit
saves with a prefetching loader; set_epoch, rollback and the checks of a saved state."""
from __future__ import annotations

import itertools
import logging
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler, TensorDataset

from elastictk.data import DataLoader, ElasticSampler, SamplerStateError, check_state, cut, order
from elastictk.inplace import State

segments = st.lists(st.tuples(st.integers(1, 6), st.integers(0, 12)), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 150), batch=st.integers(1, 7), segs=segments, drop_last=st.booleans())
def test_any_world_sizes_and_stops_take_each_offset_exactly_once(
        n: int, batch: int, segs: list[tuple[int, int]], drop_last: bool) -> None:
    """Each segment runs at its world size for some batches (the last one to the end): every
    offset is taken once; only the last short global batch pads (from the epoch's start) or
    drops (fewer than the world size), as the cut says."""
    taken: Counter[int] = Counter()
    position = padded = dropped = 0
    for i, (world, stop) in enumerate(segs):
        cuts = [cut(n, position, batch, r, world, drop_last) for r in range(world)]
        tail = (n - position) % (batch * world)  # the short last global batch, from the cut's own input
        assert (cuts[0].padded, cuts[0].dropped) == ((0, tail % world) if drop_last else ((-tail) % world, 0))
        counts = {len(c.batches) for c in cuts}
        assert len(counts) == 1, "every rank takes the same number of batches"
        run = counts.pop() if i == len(segs) - 1 else min(stop, counts.pop())
        for c in cuts:
            for b in c.batches[:run]:
                taken.update(o % n for o in b)
        position = cuts[0].position_after(run)
        assert all(c.position_after(run) == position for c in cuts)
        if position == n and n and run and cuts[0].ends[-1] == n and run == len(cuts[0].batches):
            padded += cuts[0].padded  # the short last global batch ran in this segment
            dropped += cuts[0].dropped
    dropped += n - position  # the loop saw the end: a tail too short for one each is left out
    want = Counter(range(n))
    if drop_last:
        assert not padded and dropped < segs[-1][0] + max(w for w, _ in segs)
        missing = want - taken
        assert not taken - want and sum(missing.values()) == dropped
    else:
        assert not dropped
        extra = taken - want
        assert not want - taken and sum(extra.values()) == padded
        assert Counter(o % n for o in range(n, n + padded)) == extra if n else not extra


def _take(sampler: ElasticSampler, batches: int) -> list[int]:
    """What a num_workers=0 torch loader takes: batch_size indices at a time."""
    it = iter(sampler)
    out: list[int] = []
    for _ in range(batches):
        got = list(itertools.islice(it, sampler.batch_size or 1))
        if not got:
            break
        out += got
    return out


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 120), batch=st.integers(1, 6), segs=segments, seed=st.integers(0, 2**31),
       shuffle=st.booleans())
def test_samplers_restored_at_other_world_sizes_take_the_dataset_exactly_once(
        n: int, batch: int, segs: list[tuple[int, int]], seed: int, shuffle: bool) -> None:
    """The sampler's own state_dict/load_state_dict carry the place across world sizes."""
    ds = TensorDataset(torch.zeros(n))
    saved: dict[str, int] | None = None
    taken: Counter[int] = Counter()
    for i, (world, stop) in enumerate(segs):
        final = i == len(segs) - 1
        states = []
        for r in range(world):
            s = ElasticSampler(ds, num_replicas=world, rank=r, shuffle=shuffle, seed=seed,
                               drop_last=True, batch_size=batch)
            if saved is not None:
                s.load_state_dict(saved)
                s.set_epoch(saved["epoch"])  # the restored epoch keeps its place
            taken.update(_take(s, 10**6 if final else stop))
            states.append(s.state_dict())
        assert all(x == states[0] for x in states), states
        saved = states[0]
    assert saved is not None and saved["position"] == n
    assert not taken - Counter(range(n)) and len(Counter(range(n)) - taken) < max(w for w, _ in segs)


def test_the_order_is_distributed_samplers() -> None:
    """Same seed, same epoch: the same permutation DistributedSampler draws (world 1)."""
    ds = TensorDataset(torch.zeros(37))
    ref = DistributedSampler(ds, num_replicas=1, rank=0, seed=5)
    ref.set_epoch(3)
    assert order(37, 3, 5, True) == list(ref)


def _loader(n: int, batch: int, workers: int, cls: Any = DataLoader, **kw: Any) -> tuple[Any, ElasticSampler]:
    ds = TensorDataset(torch.arange(n))
    s = ElasticSampler(ds, num_replicas=2, rank=0, seed=3, batch_size=batch, **kw)
    return cls(ds, batch_size=batch, sampler=s, num_workers=workers), s


def test_the_position_counts_batches_the_loop_took_not_what_workers_prefetched() -> None:
    loader, s = _loader(40, 2, 2)
    it = iter(loader)
    for k in range(1, 4):
        next(it)
        assert s.state_dict()["position"] == k * 4  # 2 per rank * 2 ranks
    del it


def test_torch_loader_with_workers_counts_prefetched_batches_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    """The failing side of the loader above: torch's own loader prefetches 4 batches ahead."""
    loader, s = _loader(40, 2, 2, cls=torch.utils.data.DataLoader)
    with caplog.at_level(logging.WARNING, "elastictk.data"):
        it = iter(loader)
        next(it)
        assert s.state_dict()["position"] > 4
        del it
    assert "use elastictk.data.DataLoader" in caplog.text


def test_the_loop_seeing_the_end_completes_the_epoch_and_a_restore_there_takes_nothing() -> None:
    loader, s = _loader(11, 2, 0, drop_last=True)  # tail 3: 1 each, 1 dropped
    assert [b[0].tolist() for b in loader][-1].__len__() == 1
    saved = s.state_dict()
    assert saved["position"] == 11
    again, s2 = _loader(11, 2, 0, drop_last=True)
    s2.load_state_dict(saved)
    s2.set_epoch(0)
    assert list(again) == []
    s2.set_epoch(1)
    assert len(list(again)) == 3


def test_iterating_again_without_set_epoch_repeats_the_epoch_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    loader, s = _loader(8, 2, 0)
    first = [b[0].tolist() for b in loader]
    with caplog.at_level(logging.WARNING, "elastictk.data"):
        assert [b[0].tolist() for b in loader] == first
    assert "without set_epoch()" in caplog.text


def test_set_epoch_back_before_the_restored_epoch_says_so(caplog: pytest.LogCaptureFixture) -> None:
    _, s = _loader(8, 2, 0)
    s.load_state_dict({"epoch": 3, "position": 4, "seed": 3, "samples": 8})
    s.set_epoch(3)
    assert s.position == 4
    with caplog.at_level(logging.WARNING, "elastictk.data"):
        s.set_epoch(0)
    assert s.position == 0 and "goes back before the restored epoch 3" in caplog.text


def test_padding_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    loader, s = _loader(9, 2, 0)
    with caplog.at_level(logging.WARNING, "elastictk.data"):
        for e in range(3):
            s.set_epoch(e)
            list(loader)
    assert caplog.text.count("padded with 1 samples") == 1


def test_rollback_restarts_the_running_iterator_at_the_committed_position() -> None:
    """In place (run_elastic), a rollback moves the sampler under a live iterator: the next
    batch is the first one not committed, even though workers had prefetched past it."""
    loader, s = _loader(40, 2, 2)
    state = State(sampler=s, step=0)
    it = iter(loader)
    seen = [next(it)[0].tolist() for _ in range(2)]
    state.commit()
    lost = next(it)[0].tolist()
    next(it)
    state.rollback()
    assert next(it)[0].tolist() == lost
    assert seen[0] != lost
    del it


def test_loader_and_sampler_must_agree() -> None:
    ds = TensorDataset(torch.arange(8))
    with pytest.raises(ValueError, match="give both the same"):
        DataLoader(ds, batch_size=2, sampler=ElasticSampler(ds, batch_size=4))
    with pytest.raises(ValueError, match="ElasticSampler\\(drop_last=True\\) instead"):
        DataLoader(ds, batch_size=2, drop_last=True, sampler=ElasticSampler(ds))
    s = ElasticSampler(ds, num_replicas=1, rank=0)
    DataLoader(ds, batch_size=2, sampler=s)
    assert s.batch_size == 2
    with pytest.raises(ValueError, match="needs batch_size"):
        list(ElasticSampler(ds, num_replicas=1, rank=0))
    with pytest.raises(ValueError, match="rank"):
        ElasticSampler(ds, num_replicas=2, rank=2)


def test_a_saved_state_for_another_dataset_or_seed_is_refused_in_one_line() -> None:
    with pytest.raises(SamplerStateError, match="dataset of 9 samples, this one has 8"):
        check_state({"epoch": 0, "position": 1, "seed": 0, "samples": 9}, samples=8, seed=0)
    # smaller into bigger too: a state for 8 samples names other samples in a dataset of 9
    with pytest.raises(SamplerStateError, match="dataset of 8 samples, this one has 9"):
        check_state({"epoch": 0, "position": 1, "seed": 0, "samples": 8}, samples=9, seed=0)
    with pytest.raises(SamplerStateError, match="build it with seed=4"):
        check_state({"epoch": 0, "position": 1, "seed": 4, "samples": 8}, samples=8, seed=0)
    with pytest.raises(SamplerStateError, match="out of range"):
        check_state({"epoch": 0, "position": 9, "seed": 0, "samples": 8}, samples=8, seed=0)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
    | st.text() | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
states = st.one_of(
    json_values,
    st.fixed_dictionaries({k: json_values | st.integers(-2**70, 2**70)
                           for k in ("epoch", "position", "seed", "samples")}),
    st.fixed_dictionaries({"epoch": st.integers(-3, 3) | st.booleans(),
                           "position": st.integers(-3, 20) | st.booleans() | st.floats(0, 8),
                           "seed": st.sampled_from([3, 1]), "samples": st.sampled_from([8, 9])}))


@settings(max_examples=400, deadline=None)
@given(state=states)
def test_load_state_dict_takes_only_its_own_plain_ints(state: Any) -> None:
    """A saved state is read from a snapshot: garbage (nested, huge, NaN, wrong types) is a
    SamplerStateError naming the field, never another exception or a wrong position."""
    _, s = _loader(8, 2, 0)
    before = s.state_dict()
    try:
        s.load_state_dict(state)
    except SamplerStateError as e:
        assert "\n" not in str(e)
        assert s.state_dict() == before
        return
    got = s.state_dict()
    assert got == {**state, "samples": 8} and all(type(v) is int for v in got.values())
    assert 0 <= s.position <= 8

"""The restore agreement and the local slots it reads, in one process (threads play the ranks).

Each rank's Snapshotter writes real slots of a real agent memfd (Holder); ``restoring.gather`` is
replaced by an all-gather across threads, so ``Snapshotter.restore``'s own loop decides.
"""
from __future__ import annotations

import struct
import threading
from typing import Any, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastictk.snapshot import restoring
from elastictk.snapshot.codec import checksum, used_size
from elastictk.snapshot.codec import read as codec_read
from elastictk.snapshot.local import META_BASE, Holder, HolderError, Region
from elastictk.snapshot.settings import Settings
from elastictk.snapshot.worker import Restored, Snapshotter


def tree(step: int) -> dict[str, Any]:
    return {"objects": {"w": torch.full((4, 3), float(step))}, "values": {"step": step}}


def snapshotters(h: Holder, world: int) -> list[Snapshotter]:
    s = Settings(tiers=("local",), regions=h.path, region_size=h.region, memory=h.memory)
    return [Snapshotter(s, rank=r, world=world, local_rank=r, local_world=world) for r in range(world)]


class ThreadGather:
    """``all_gather_object`` across threads: each rank's thread calls it in the same order."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.box: list[Any] = [None] * world
        self.barrier = threading.Barrier(world)
        self.ranks = threading.local()

    def __call__(self, obj: Any, world: int) -> list[Any]:
        self.box[self.ranks.rank] = obj
        self.barrier.wait()
        out = list(self.box)
        self.barrier.wait()
        return out


def restore_all(snaps: list[Snapshotter], monkeypatch: pytest.MonkeyPatch) -> list[Optional[Restored]]:
    g = ThreadGather(len(snaps))
    monkeypatch.setattr(restoring, "gather", g)
    out: list[Optional[Restored]] = [None] * len(snaps)
    errors: list[BaseException] = []

    def one(r: int) -> None:
        g.ranks.rank = r
        try:
            out[r] = snaps[r].restore()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            g.barrier.abort()

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(snaps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return out


def test_ranks_holding_different_steps_restore_the_newest_step_all_hold(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    with Holder(2, 1 << 20) as h:
        snaps = snapshotters(h, 2)
        for r, steps in enumerate(([3, 4], [2, 3])):  # rank 0 is one commit ahead of rank 1
            for step in steps:
                snaps[r].commit(tree(step), step)
            snaps[r].wait()
        got = restore_all(snaps, monkeypatch)
        assert [g.step if g else None for g in got] == [3, 3]
        assert all(torch.equal(g.state["objects"]["w"], tree(3)["objects"]["w"]) for g in got if g)
        for s in snaps:
            s.close()
    assert capfd.readouterr().err.count("restored step 3 from local memory") == 2


def test_an_unchecked_slot_is_not_restored_the_older_one_is(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """A slot published but never checksummed (killed before the check) and holding changed
    bytes: restoring it would give wrong weights; the older, checked slot is restored."""
    with Holder(1, 1 << 20) as h:
        (s,) = snapshotters(h, 1)
        s.commit(tree(1), 1)
        s.commit(tree(2), 2)
        s.wait()
        r = s.region
        assert r is not None
        m = r.ready(0, 1)[0]
        assert m.step == 2 and m.checked
        struct.pack_into("@I", r.mm, META_BASE + 64 * m.index + 4, 0)  # killed before the check
        raw = r.data(m.index)
        end = used_size(raw[:m.length])  # the end of the last tensor's bytes
        raw[end - 4:end] = struct.pack("<f", 99.0)  # and a weight changed
        assert codec_read(raw[:m.length])["objects"]["w"][-1, -1] == 99.0
        got = restore_all([s], monkeypatch)[0]
        assert got is not None and got.step == 1
        assert torch.equal(got.state["objects"]["w"], tree(1)["objects"]["w"])
        s.close()
    err = capfd.readouterr().err
    assert "local part of step 2 is torn (never checksummed: its worker was killed before the check)" in err
    assert "restoring step 1" in err


def test_a_checked_slot_with_changed_bytes_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    with Holder(1, 1 << 20) as h:
        (s,) = snapshotters(h, 1)
        for step in (1, 2):
            s.commit(tree(step), step)
        s.wait()
        r = s.region
        assert r is not None
        m = r.ready(0, 1)[0]
        r.data(m.index)[m.length - 1] ^= 0x40
        got = restore_all([s], monkeypatch)[0]
        assert got is not None and got.step == 1
        s.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=1, max_size=1024), st.integers(0, 1023))
def test_a_region_header_of_garbage_is_refused_or_restores_nothing_wrong(garbage: bytes, at: int) -> None:
    """Anything in the header and slot metas (written by a worker that died mid-write, or by
    anything else with the memfd): opening refuses it in one line, or reading it never raises
    and never restores a slot whose checksum does not match."""
    with Holder(1, 1 << 20) as h:
        (s,) = snapshotters(h, 1)
        s.commit(tree(1), 1)
        s.wait()
        assert s.region is not None
        chunk = garbage[:1024 - at]
        s.region.mm[at:at + len(chunk)] = chunk
        s.close()
        try:
            r = Region(h.path, 0, h.region, h.memory, 1)
        except HolderError as e:
            assert "\n" not in str(e)
            return
        try:
            for m in r.ready(0, 1):
                why = r.verify(m)
                assert why is None or isinstance(why, str)
                if why is None:  # only a slot whose stored checksum matches its bytes
                    assert m.checked and checksum(r.data(m.index)[:m.length]) == m.digest
            r.begin()  # whatever ``active`` says, the next write goes to slot 0 or 1
        finally:
            r.close()

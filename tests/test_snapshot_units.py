"""The snapshot tiers' parts in one process: codec, slot protocol, disk parts, agreement, flags."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elastictk.cli.args import parse_args
from elastictk.cli.values import UsageError
from elastictk.snapshot import codec
from elastictk.snapshot import dcptree as dcp_tier
from elastictk.snapshot.dcp import DcpDisk
from elastictk.snapshot.local import Holder, Region, SnapshotTooBig
from elastictk.snapshot.settings import SettingsError, parse_bytes
from elastictk.snapshot.worker import newest_common


def test_codec_round_trips_nested_state_exactly() -> None:
    state = {"objects": {"m": {"w": torch.randn(3, 5), "b": torch.arange(4, dtype=torch.int16),
                               "t": torch.randn(6, 4).t(), "e": torch.empty(0, 7),
                               "s": torch.tensor(3.5)}},
             "values": {"step": 7, "name": "x", "l": [1, (2, 3)]}}
    plan = codec.Plan(state)
    buf = bytearray(plan.size)
    plan.write(memoryview(buf))
    back = codec.read(memoryview(buf))
    assert back["values"] == state["values"]
    for k, v in state["objects"]["m"].items():
        assert torch.equal(back["objects"]["m"][k], v) and back["objects"]["m"][k].dtype == v.dtype


def region(holder: Holder) -> Region:
    return Region(holder.path, 0, holder.region, holder.memory, 1)


def test_a_copy_cut_short_leaves_the_previous_slot_whole() -> None:
    with Holder(1, 1 << 20) as h:
        r = region(h)
        for step in (1, 2):
            i = r.begin()
            r.data(i)[:4] = bytes([step] * 4)
            r.publish(i, step, 4, 0, 1)
            r.seal(i)
        assert [m.step for m in r.ready(0, 1)] == [2, 1]
        r.begin()  # step 3's copy starts, and the worker dies: step 1's slot is given up
        assert [m.step for m in r.ready(0, 1)] == [2]
        m = r.ready(0, 1)[0]
        assert r.verify(m) is None
        r.data(m.index)[0] ^= 1
        assert "checksum" in (r.verify(m) or "")
        assert r.ready(1, 1) == [] and r.ready(0, 2) == []  # another rank's or world's: not ours
        r.close()


def test_a_snapshot_that_does_not_fit_is_refused_naming_the_sizes() -> None:
    with Holder(2, 1_000_000) as h:
        r = Region(h.path, 1, h.region, h.memory, 2)
        with pytest.raises(SnapshotTooBig, match=r"is 4\.0 MB, its local slot holds 245\.8 kB"):
            r.check_fits(4_000_000, 3, 1)
        r.close()


def _tree(step: int) -> dict:
    return {"objects": {"m": {"w": torch.full((3, 2), float(step)), "b": torch.arange(step)},
                        "opt": {"state": {0: {"buf": torch.ones(2) * step}},
                                "param_groups": [{"lr": 0.1, "params": [0]}]}},
            "values": {"step": step, "name": "x/y#1"}}


def test_disk_keeps_the_two_newest_complete_steps_and_checks_files(tmp_path: Path) -> None:
    d = DcpDisk(str(tmp_path), 0, 1)
    for step in (2, 4, 6):
        assert d.save(step, _tree(step), None)
    assert d.complete_steps() == [6, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000000004", "step-0000000006"]
    assert d.verify(6) is None
    back = d.load(6, None)
    assert back["values"] == _tree(6)["values"]
    assert back["objects"]["opt"]["state"].keys() == {0}  # int keys come back as int keys
    assert back["objects"]["opt"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert torch.equal(back["objects"]["m"]["w"], _tree(6)["objects"]["m"]["w"])
    part = tmp_path / "step-0000000006" / "__0_0.distcp"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 1
    part.write_bytes(bytes(data))
    assert "__0_0.distcp: checksum" in (d.verify(6) or "")
    assert DcpDisk(str(tmp_path), 0, 2).complete_steps() == [6, 4]  # any world size reads them
    # of 2 ranks, rank 0 checks the one tensor file; .metadata and skeleton.pt every rank checks
    assert DcpDisk(str(tmp_path), 1, 2).verify(6) is None
    assert "__0_0.distcp: checksum" in (DcpDisk(str(tmp_path), 0, 2).verify(6) or "")


def test_a_step_without_its_marker_is_not_complete(tmp_path: Path) -> None:
    d = DcpDisk(str(tmp_path), 0, 1)
    assert d.save(3, _tree(3), None)
    (tmp_path / "step-0000000003" / "COMPLETE").unlink()
    assert d.complete_steps() == []
    assert "COMPLETE is missing" in (d.verify(3) or "")


keys_ = st.one_of(st.text(alphabet="ab/#%0", max_size=3), st.integers(0, 3))
trees = st.recursive(st.one_of(st.integers(), st.text(max_size=2), st.just("T")),
                     lambda kids: st.one_of(st.lists(kids, max_size=3),
                                            st.dictionaries(keys_, kids, max_size=3)), max_leaves=12)


@given(trees)
def test_flatten_round_trips_any_structure_with_unique_keys(tree: object) -> None:
    def tensors(x: object) -> object:
        if x == "T":
            return torch.zeros(1)
        if isinstance(x, dict):
            return {k: tensors(v) for k, v in x.items()}
        if isinstance(x, list):
            return [tensors(v) for v in x]
        return x

    real = tensors(tree)
    skeleton, flat = dcp_tier.flatten(real)
    assert len(flat) == len(dcp_tier.keys(skeleton))  # one key per tensor, none shared
    assert dcp_tier.unflatten(skeleton, flat) == real or _same(dcp_tier.unflatten(skeleton, flat), real)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def test_ranks_agree_on_the_newest_step_all_hold() -> None:
    assert newest_common([[5, 4], [4, 3]]) == 4
    assert newest_common([[5, 4], [6, 5], [5]]) == 5
    assert newest_common([[5], [4]]) is None
    assert newest_common([[], []]) is None


def test_flags(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    c = parse_args(["--snapshot", "local,disk", "--snapshot-dir", str(tmp_path), "--snapshot-every",
                    "5", "--snapshot-memory", "2G", str(script)], environ={})
    assert (c.snapshot, c.snapshot_dir, c.snapshot_every, c.snapshot_memory) == (
        ("local", "disk"), str(tmp_path), 5, 2 * 10**9)
    assert parse_args(["--snapshot-dir", "d", str(script)], environ={}).snapshot == ("disk",)
    assert parse_args([str(script)], environ={"ELASTICTK_SNAPSHOT": "local"}).snapshot == ("local",)
    assert parse_args(["--snapshot", "peer", str(script)], environ={}).snapshot == ("local", "peer")
    tight = parse_args(["--snapshot", "peer", "--snapshot-replica-memory", "1G", str(script)], environ={})
    assert (tight.snapshot_replica_memory, tight.warnings) == (10**9, ())
    assert parse_args([str(script)], environ={"ELASTICTK_SNAPSHOT": "peer",
                                              "ELASTICTK_SNAPSHOT_REPLICA_MEMORY": "2G"}).snapshot_replica_memory == 2 * 10**9
    idle = parse_args(["--snapshot", "local", "--snapshot-replica-memory", "1G", str(script)], environ={})
    assert idle.warnings == ("--snapshot-replica-memory bounds the peer tier's replicas, and the peer tier is "
                             "off: add --snapshot local,peer",), "a flag that can do nothing says so"
    for bad, msg in ((["--snapshot", "remote"], "unknown tier 'remote'"),
                     (["--snapshot", "local,peer", "--snapshot-replicas", "0"], "at least 1"),
                     (["--snapshot", "disk"], "needs --snapshot-dir"),
                     (["--snapshot", "local", "--snapshot-memory", "lots"], "give bytes"),
                     (["--snapshot", "peer", "--snapshot-replica-memory", "lots"], "--snapshot-replica-memory lots: give bytes"),
                     (["--snapshot", "peer", "--snapshot-replica-memory", "1e30"], "more than this host's memory"),
                     (["--snapshot-dir", "d", "--snapshot-every", "0"], "at least 1")):
        with pytest.raises(UsageError, match=msg):
            parse_args([*bad, str(script)], environ={})


def test_bytes() -> None:
    assert parse_bytes("512M", "x") == 512 * 10**6 and parse_bytes("1GiB", "x") == 2**30
    with pytest.raises(SettingsError):
        parse_bytes("10", "x")


def test_state_under_torchrun_style_env_uses_the_disk_tier_only(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from elastictk import State

    for k in [k for k in os.environ if k.startswith("ELASTICTK_SNAPSHOT")]:
        monkeypatch.delenv(k)
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    s = State(model=m, optimizer=opt, step=0, snapshot_dir=str(tmp_path), snapshot_every=2)
    for _ in range(3):
        m(torch.ones(1, 3)).sum().backward()
        opt.step()
        s.step += 1
        s.commit()
    s.flush()
    want = {k: v.clone() for k, v in m.state_dict().items()}
    s.step = 99
    s.rollback()  # the in-process commit point still works, decoded from the buffer
    assert s.step == 3 and all(torch.equal(want[k], v) for k, v in m.state_dict().items())
    m2 = torch.nn.Linear(3, 2)
    s2 = State(model=m2, optimizer=torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9), step=0,
               snapshot_dir=str(tmp_path), snapshot_every=2)
    assert s2.restore() == 2 and s2.step == 2
    assert State(model=torch.nn.Linear(3, 2), step=0).restore() is None  # no tier: nothing

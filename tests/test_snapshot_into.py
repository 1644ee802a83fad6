"""Restore in place (snapshot/into.py): a snapshot copied into the tensors the script holds,
chunk by chunk, checksummed on a second thread while the next chunk is copied."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from elastictk import State
from elastictk.snapshot import into
from elastictk.snapshot.codec import Plan, checksum
from elastictk.snapshot.local import Holder


def _model_opt(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 7))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(3, 64)).pow(2).sum().backward()
    opt.step()


def _serialized(state: Any) -> bytearray:
    plan = Plan(state)
    buf = bytearray(plan.size)
    plan.write(memoryview(buf))
    return buf


def _ptrs(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[int]:
    return [p.data_ptr() for p in model.parameters()] + [
        t.data_ptr() for s in opt.state.values() for t in s.values() if t.numel() > 1]


@pytest.mark.parametrize("chunk", [4096, 1 << 20])
def test_a_part_is_copied_into_the_tensors_held_and_checksummed_across_chunks(
        chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(into, "CHUNK", chunk)  # 4 kB: tensors span many chunks
    model, opt = _model_opt(0)
    _train(model, opt)
    raw = _serialized({"model": model.state_dict(), "opt": opt.state_dict()})
    saved = [t.clone() for t in model.state_dict().values()]
    fresh_m, fresh_o = _model_opt(1)
    _train(fresh_m, fresh_o)  # holds Adam moments of its own already
    before = _ptrs(fresh_m, fresh_o)
    tree, why = into.load_verified(memoryview(raw), checksum(raw),
                                   {"model": fresh_m.state_dict(), "opt": fresh_o.state_dict()})
    assert why is None
    fresh_m.load_state_dict(tree["model"])
    fresh_o.load_state_dict(tree["opt"])
    assert _ptrs(fresh_m, fresh_o) == before, "no tensor allocated: copied in place"
    assert all(torch.equal(a, b) for a, b in zip(fresh_m.state_dict().values(), saved))
    moments = [s["exp_avg"] for s in opt.state.values()]
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, fresh_o.state.values()))


def test_a_flipped_byte_is_torn() -> None:
    model, opt = _model_opt(0)
    raw = _serialized({"model": model.state_dict()})
    digest = checksum(raw)
    raw[-5] ^= 1
    _, why = into.load_verified(memoryview(raw), digest, {"model": model.state_dict()})
    assert why is not None and why.startswith("checksum ")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_garbage_parts_are_torn_never_an_exception(data: st.DataObject) -> None:
    model, _ = _model_opt(0)
    good = _serialized({"model": model.state_dict(), "values": {"step": 3}})
    how = data.draw(st.sampled_from(["random", "truncated", "mutated", "huge-length"]))
    if how == "random":
        raw = bytearray(data.draw(st.binary(min_size=8, max_size=4096)))
    elif how == "truncated":
        raw = good[:data.draw(st.integers(8, len(good) - 1))]
    elif how == "mutated":
        raw = bytearray(good)
        for _ in range(data.draw(st.integers(1, 8))):
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        assume(raw != good)
    else:
        raw = bytearray(good)
        raw[:8] = (2**63).to_bytes(8, "little")
    _, why = into.load_verified(memoryview(raw), checksum(good), {"model": model.state_dict()})
    assert why is not None


def test_state_restore_from_local_memory_keeps_the_models_tensors(tmp_path: Any) -> None:
    """End to end through State: the parameters (and a resumed optimizer's moments) are the
    same tensors after restore(), holding the committed values."""
    with Holder(1, 64 << 20) as h:
        env = {**h.env(), "ELASTICTK_SNAPSHOT": "local"}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            model, opt = _model_opt(0)
            _train(model, opt)
            state = State(model=model, optimizer=opt, step=0)
            state.step = 5
            state.commit()
            state.flush()
            saved = [t.clone() for t in model.state_dict().values()]
            fresh_m, fresh_o = _model_opt(2)
            _train(fresh_m, fresh_o)
            before = _ptrs(fresh_m, fresh_o)
            fresh = State(model=fresh_m, optimizer=fresh_o, step=0)
            assert fresh.restore() == 5
            assert _ptrs(fresh_m, fresh_o) == before
            assert all(torch.equal(a, b) for a, b in zip(fresh_m.state_dict().values(), saved))
            for snap in (state._snap, fresh._snap):
                snap.close()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

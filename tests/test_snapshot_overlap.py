"""Pipelined commits (``--snapshot-overlap 1``): the optimizer's tensors are copied while the next
step runs, the optimizer waits for the copy, and a tensor changed behind the optimizer's back
drops the commit instead of publishing a mix of two steps.

The background copy is held back (``Plan.write_tensors`` waits for the test's ``go``, then
sleeps) so that the optimizer's step certainly comes while it runs: what these tests judge then
happens every time, on a loaded host too (a sleep alone was outrun when the main thread waited
longer than it for a core).
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from elastictk import State
from elastictk.cli.args import parse_args
from elastictk.cli.values import UsageError
from elastictk.snapshot import codec, overlap
from elastictk.snapshot.local import Holder
from elastictk.snapshot.settings import ENV_OVERLAP, ENV_TIERS, Settings, SettingsError
from tests.test_snapshot_recovery import launch, reference, restarts, same, weights  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def local_tier(monkeypatch: pytest.MonkeyPatch) -> Iterator[Holder]:
    with Holder(1, 1 << 24) as h:
        for k, v in {**h.env(), ENV_TIERS: "local", "WORLD_SIZE": "1", "RANK": "0",
                     "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
            monkeypatch.setenv(k, v)
        yield h


def slow_copy(monkeypatch: pytest.MonkeyPatch, order: list[str], delay: float = 0.3) -> threading.Event:
    """The deferred copy starts once the returned event is set (the test's moment), ``delay`` s
    later, and notes when it is done."""
    real = codec.Plan.write_tensors
    go = threading.Event()

    def slow(self: codec.Plan, out: memoryview, indices: list[int]) -> None:
        if threading.current_thread() is not threading.main_thread():
            assert go.wait(300), "the test never let the copy go"
            time.sleep(delay)
            real(self, out, indices)
            order.append("copied")
        else:
            real(self, out, indices)

    monkeypatch.setattr(codec.Plan, "write_tensors", slow)
    return go


def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, order: list[str] | None = None) -> None:
    opt.zero_grad()
    model(torch.randn(8, 64)).pow(2).sum().backward()  # BatchNorm's buffers change here
    opt.step()
    if order is not None:
        order.append("stepped")


def snapshot_of(state: State) -> dict[str, torch.Tensor]:
    step_state = state._snap.last()
    assert step_state is not None
    return step_state[1]["objects"]["model"]


def clone(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_optimizer_waits_for_the_copy_and_the_snapshot_is_the_committed_state(
        local_tier: Holder, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    go = slow_copy(monkeypatch, order)
    model, opt = model_and_opt()
    state = State(model=model, optimizer=opt, step=0, snapshot_overlap=True)
    train(model, opt)  # the optimizer has momentum from here on
    for _ in range(3):
        go.clear()
        state.step += 1
        state.commit()
        assert order[-1:] != ["copied"]  # commit() returned before the copy was done
        committed = clone(model)
        go.set()
        train(model, opt, order)  # forward/backward overlap the copy; the step waits for it
        state.flush()
        got = snapshot_of(state)
        assert all(torch.equal(got[k], committed[k]) for k in committed)
        assert not torch.equal(got["0.weight"], model.state_dict()["0.weight"])  # the step moved on
    assert order == ["copied", "stepped"] * 3, order
    assert state._snap.region.meta(state._snap.region.active).step == 3


def test_without_the_gate_the_version_check_drops_the_commit_in_one_line(
        local_tier: Holder, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """The failing side of the gate: with its hook gone, the optimizer's step lands during the
    copy; the version check sees it, and the previous snapshot stays the newest."""
    go = slow_copy(monkeypatch, [])
    monkeypatch.setattr(overlap.Gate, "_before_step", lambda *a: None)
    model, opt = model_and_opt()
    state = State(model=model, optimizer=opt, step=0, snapshot_overlap=True)
    train(model, opt)
    state.step = 1
    go.set()
    state.commit()
    state.flush()  # step 1 copied whole (nothing ran meanwhile)
    one = clone(model)
    go.clear()
    state.step = 2
    state.commit()
    train(model, opt)  # not held back: changes the parameters mid-copy
    go.set()
    state.flush()
    err = capfd.readouterr().err
    lines = [x for x in err.splitlines() if "is dropped" in x]
    assert len(lines) == 1, err
    assert "snapshot of step 2 is dropped" in lines[0] and "stays step 1" in lines[0]
    assert state._snap.overlap is False  # copies on the training thread from now on
    got = snapshot_of(state)
    assert all(torch.equal(got[k], one[k]) for k in one)
    assert state._snap.region.meta(state._snap.region.active).step == 1


def test_with_neither_gate_nor_check_the_snapshot_would_mix_two_steps(
        local_tier: Holder, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the two guards prevent, shown: the published snapshot is not the committed state."""
    go = slow_copy(monkeypatch, [])
    monkeypatch.setattr(overlap.Gate, "_before_step", lambda *a: None)
    monkeypatch.setattr(overlap, "changed", lambda *a: None)
    model, opt = model_and_opt()
    state = State(model=model, optimizer=opt, step=0, snapshot_overlap=True)
    train(model, opt)
    state.step = 1
    state.commit()
    committed = clone(model)
    train(model, opt)
    go.set()
    state.flush()
    got = snapshot_of(state)
    assert not torch.equal(got["0.weight"], committed["0.weight"])
    assert torch.equal(got["1.running_mean"], committed["1.running_mean"])  # buffers: copied in commit


def test_a_tensor_changed_outside_the_optimizer_is_caught(
        local_tier: Holder, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    go = slow_copy(monkeypatch, [])
    model, opt = model_and_opt()
    state = State(model=model, optimizer=opt, step=0, snapshot_overlap=True)
    train(model, opt)
    state.step = 1
    state.commit()
    with torch.no_grad():
        model[0].weight.clamp_(-0.01, 0.01)  # in place, not through the optimizer
    go.set()
    state.flush()
    assert "snapshot of step 1 is dropped" in capfd.readouterr().err
    assert state._snap.last() is None  # nothing older to keep


def test_settings_and_flags() -> None:
    assert Settings.resolve({ENV_OVERLAP: "1", ENV_TIERS: "local"}).overlap is True
    assert Settings.resolve({ENV_TIERS: "local"}).overlap is False
    with pytest.raises(SettingsError, match=ENV_OVERLAP):
        Settings.resolve({ENV_OVERLAP: "sometimes"})
    script = str(ROOT / "examples" / "train.py")
    cfg = parse_args(["--snapshot", "local", "--snapshot-overlap", "1", script], {}, check=False)
    assert cfg.snapshot_overlap is True
    with pytest.raises(UsageError) as e:
        parse_args(["--snapshot", "local", "--snapshot-overlap", "maybe", script], {}, check=False)
    assert "--snapshot-overlap" in str(e.value) and "\n" not in str(e.value)


def test_a_killed_worker_restores_the_fault_free_weights_with_pipelined_commits(
        tmp_path: Path, reference: dict[str, Any]) -> None:  # noqa: F811
    code, out, recs = launch(tmp_path, "overlap", "--snapshot", "local", "--snapshot-overlap", "1",
                             "--max-restarts", "1", job_args=("--kill", "5"))
    assert code == 0, out[-3000:]
    assert {r["restored"] for r in restarts(recs, 1)} == {5}, out[-3000:]
    assert "is dropped" not in out
    assert same(weights(tmp_path / "overlap"), reference)


def test_the_environment_reaches_the_workers(tmp_path: Path) -> None:
    from elastictk.agent.launch import snapshot_env

    cfg = parse_args(["--snapshot", "local", "--snapshot-overlap", "1", str(ROOT / "examples" / "train.py")],
                     {}, check=False)
    assert snapshot_env(cfg)[ENV_OVERLAP] == "1"
    assert ENV_OVERLAP not in snapshot_env(parse_args(["--snapshot", "local", str(ROOT / "examples" / "train.py")],
                                                      {}, check=False))
    assert os.environ.get(ENV_OVERLAP) is None

"""The pure and local parts of in-place recovery: State, sharding, generation records, the
restart charge, frozen-process detection, and replacing one worker of a running group."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elastictk.inplace import Generation, State, StateError, is_peer_failure, shard
from elastictk.store import FileStore
from elastictk.supervisor.env import Assignment
from elastictk.supervisor.group import GroupStateError, WorkerGroup
from elastictk.agent.inplace import spend_restart
from elastictk.lifetime.procfs import is_frozen, parse_stat
from elastictk.agent.policy import RestartPolicy
from elastictk.supervisor.spec import Std, WorkerSpec, python_script_argv


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2, dtype=torch.float64)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
    g = torch.Generator().manual_seed(k)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    opt.step()


def _flat(state: State) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in state.model.parameters()]
    out += [v["momentum_buffer"].clone() for v in state.optimizer.state.values()]
    return out


def test_rollback_restores_weights_momentum_and_values_and_can_repeat() -> None:
    model, opt = _trained()
    state = State(model=model, optimizer=opt, step=0, note="a")
    _step(model, opt, 0)
    state.step = 1
    state.commit()
    at_commit = _flat(state)
    for round_ in range(2):  # the commit survives a rollback: a second one lands there again
        for k in range(3):
            _step(model, opt, 10 + k + round_)
        state.step, state.note = 99, "b"
        state.rollback()
        assert state.step == 1 and state.note == "a"
        assert all(torch.equal(a, b) for a, b in zip(_flat(state), at_commit))
    # The steps redone after a rollback give what they gave the first time.
    _step(model, opt, 1)
    again = _flat(state)
    state.rollback()
    _step(model, opt, 1)
    assert all(torch.equal(a, b) for a, b in zip(_flat(state), again))


def test_bytes_carry_a_commit_to_a_fresh_state() -> None:
    model, opt = _trained(0)
    src = State(model=model, optimizer=opt, step=0)
    for k in range(3):
        _step(model, opt, k)
    src.step = 3
    src.commit()
    m2, o2 = _trained(1)
    dst = State(model=m2, optimizer=o2, step=0)
    dst.load_bytes(src.to_bytes())
    assert dst.step == 3 and dst.committed_step() == 3
    assert all(torch.equal(a, b) for a, b in zip(_flat(dst), _flat(src)))
    _step(model, opt, 7)
    _step(m2, o2, 7)
    assert all(torch.equal(a, b) for a, b in zip(_flat(dst), _flat(src)))


def test_state_misuse_says_what_to_do() -> None:
    model, opt = _trained()
    state = State(model=model, optimizer=opt, step=0)
    with pytest.raises(StateError, match="commit"):
        state.rollback()
    with pytest.raises(StateError, match="register"):
        state.epoch = 1
    with pytest.raises(StateError, match="in place"):
        state.model = model
    with pytest.raises(StateError, match="reserved"):
        State(commit=1)
    with pytest.raises(AttributeError, match="register"):
        _ = state.epoch
    other = State(model=_trained()[0], step=0)
    other.commit()
    with pytest.raises(StateError, match="optimizer"):
        state.load_bytes(other.to_bytes())
    assert state.committed_step() == -1


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_shards_cover_every_index_once_in_order(size: int, world: int) -> None:
    parts = [shard(size, r, world) for r in range(world)]
    assert [i for p in parts for i in p] == list(range(size))
    lens = {len(p) for p in parts}
    assert max(lens) - min(lens) <= 1


def test_shard_rejects_ranks_outside_the_world() -> None:
    with pytest.raises(ValueError, match="rank < world_size"):
        shard(10, 3, 3)


@given(st.integers(0, 2**31), st.integers(1, 2**20), st.integers(0, 1000), st.text(max_size=40))
def test_generation_records_round_trip(gen: int, world: int, restarts: int, reason: str) -> None:
    g = Generation(gen, world, restarts, reason)
    assert Generation.from_json(g.to_json()) == g


@pytest.mark.parametrize("raw", [b"", b"{}", b"[1]", json.dumps({"schema": "x", "gen": 1}).encode(),
                                 Generation(1, 2).to_json().replace(b'"world_size": 2', b'"world_size": 0')])
def test_garbage_generation_record_is_one_line(raw: bytes) -> None:
    with pytest.raises(ValueError) as e:
        Generation.from_json(raw)
    assert "\n" not in str(e.value) and "generation record" in str(e.value)


def test_peer_failures_are_told_from_the_steps_own_bugs() -> None:
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5: Connection reset by peer")
    timeout = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv")
    assert is_peer_failure(gloo) and is_peer_failure(timeout)
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x4 and 3x2)"))
    assert not is_peer_failure(ValueError("Connection reset by peer"))


def test_stat_lines_parse_with_spaces_and_parens_in_the_command() -> None:
    tail = " ".join(str(n) for n in range(4, 22)).encode()  # fields 6.. up to the start time
    odd = parse_stat(b"123 (a) b) T 1 2 3 " + tail)
    assert (odd.state, odd.ppid, odd.pgrp, odd.session) == ("T", 1, 2, 3)
    plain = parse_stat(b"7 (python3) S 1 7 7 " + tail)
    assert (plain.state, plain.session, plain.start_time) == ("S", 7, 19)


def test_a_stopped_process_is_frozen_a_running_one_is_not() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not is_frozen(p.pid)
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while not is_frozen(p.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert is_frozen(p.pid)
    finally:
        p.kill()
        p.wait()
    assert not is_frozen(p.pid)


def test_in_place_recoveries_spend_the_same_budget_as_restarts(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "job")
    policy = RestartPolicy(max_restarts=2)
    got = [spend_restart(store, policy, f"rank {i}: SIGKILL") for i in range(3)]
    assert [(d.action, d.restart_count) for d in got] == [("restart", 1), ("restart", 2), ("give_up", 3)]
    assert "max-restarts" in got[-1].reason
    from elastictk.agent.coordination import restart_count

    assert restart_count(store) == 3  # what a worker started now would see
    store.close()


def test_respawn_replaces_one_worker_and_keeps_the_other(tmp_path: Path) -> None:
    code = tmp_path / "w.py"
    code.write_text("import os, time\nprint('restart', os.environ['TORCHELASTIC_RESTART_COUNT'], flush=True)\n"
                    "time.sleep(60)\n")
    spec = WorkerSpec(python_script_argv(str(code)), local_world_size=2,
                      start_method="subprocess", redirects=Std.ALL, grace_period=1)
    a = Assignment.homogeneous(0, 1, 2, master_addr="127.0.0.1", master_port=29511, run_id="job")
    with WorkerGroup(spec, tmp_path / "logs") as g:
        g.start(0, a, extra_env={"EXTRA": "1"})
        before = g.pids()
        with pytest.raises(GroupStateError, match="exited"):
            g.respawn(0, 1, "gen_1")
        assert g.signal_one(1, signal.SIGKILL)
        (dead,) = g.wait_any(timeout=60)
        assert dead.local_rank == 1 and dead.signal_name == "SIGKILL"
        new = g.respawn(1, 1, "gen_1")
        assert g.pids() == {0: before[0], 1: new} and new != before[1]
        assert g.running == [0, 1] and [r.pid for r in g.replaced] == [before[1]]
        log = g.attempt_dir / "gen_1" / "1" / "stdout.log"  # type: ignore[operator]
        deadline = time.monotonic() + 60
        while "restart 1" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "restart 1" in log.read_text()
        results = g.stop()
    assert set(results) == {0, 1} and all(r.stopped for r in results.values())

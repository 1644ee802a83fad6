"""The local tier at another world size: replicated state restores from any whole copy.

Real ``elastictk-run`` agents (one worker each) on one file-store rendezvous, restart-all,
``--snapshot local``. The first world trains to step ``HOLD``; every rank passes a barrier (all
have committed it), rank 0 saves the state it holds, and the workers wait. Then a node leaves
(its agent SIGKILLed: 3 -> 2) or joins (a third agent: 2 -> 3), the agents restart their
workers in a world of the other size, and every rank of it must restore step ``HOLD`` from the
agents' memory (the newcomer over the process group), exactly the saved weights and momentum.
Every process seeds its model from its PID, so only a restore gives the saved state (red: with
``candidates`` returning nothing the ranks restore nothing and start from step 0).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from hypothesis import given, strategies as st

from elastictk.snapshot import codec
from elastictk.snapshot.copies import candidates, content_digest, pick, sharded_note
from elastictk.snapshot.local import Holder, Region

ROOT = Path(__file__).resolve().parent.parent
HOLD = 4
STEPS = 7
CONF = "last_call_timeout=1,heartbeat_interval=0.2,heartbeat_timeout=3,join_timeout=60"

JOB = r'''
import argparse, json, os, signal
import torch, torch.distributed as dist
from elastictk import State

p = argparse.ArgumentParser()
p.add_argument("--dir"); p.add_argument("--hold", type=int); p.add_argument("--hold-world", type=int)
p.add_argument("--steps", type=int)
a = p.parse_args()
held = os.path.join(a.dir, "held")
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(os.getpid())          # only a restore gives the saved weights
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
state = State(model=model, optimizer=opt, step=0)
restored = state.restore()
if restored is None:                    # a first start: replicate rank 0's weights, as DDP does
    with torch.no_grad():
        for q in model.parameters():
            dist.broadcast(q, 0)

def dump(name):
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": state.step},
               os.path.join(a.dir, name))

def wait():                             # until the agent restarts this worker
    while True:
        signal.pause()

with open(os.path.join(a.dir, "record.jsonl"), "a") as f:
    f.write(json.dumps({"rank": rank, "world": world, "restored": restored,
                        "held": os.path.exists(held)}) + "\n")
if not os.path.exists(held) and world != a.hold_world:
    wait()                              # the first world is not complete yet
if restored is not None:
    dump(f"restored-w{world}-r{rank}.pt")
while state.step < a.steps:
    s = state.step
    if s == a.hold and not os.path.exists(held):
        dist.barrier()                  # every rank has committed step s
        if rank == 0:
            dump("saved.pt")
            open(held, "w").close()
        wait()
    g = torch.Generator().manual_seed(s * 97 + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    opt.zero_grad()
    (model(x) - y).pow(2).mean().backward()
    for q in model.parameters():
        dist.all_reduce(q.grad)
    opt.step()
    state.step = s + 1
    state.commit()
print(f"rank {rank} of {world}: done at step {state.step}", flush=True)
'''


class Agents:
    """The job's agents; every one reaped at the end."""

    def __init__(self, tmp: Path, hold_world: int) -> None:
        self.tmp, self.hold_world = tmp, hold_world
        self.script = tmp / "job.py"
        self.script.write_text(JOB)
        self.procs: list[subprocess.Popen[str]] = []

    def start(self) -> None:
        i = len(self.procs)
        cmd = [sys.executable, "-m", "elastictk.run", "--nnodes", "2:3", "--nproc-per-node", "1",
               "--rdzv-backend", "file", "--rdzv-endpoint", str(self.tmp / "rdzv"), "--rdzv-id", "reworld",
               "--rdzv-conf", CONF, "--max-restarts", "3", "--snapshot", "local",
               "--log-dir", str(self.tmp / f"logs{i}"), "--event-log", str(self.tmp / f"events{i}.jsonl"),
               str(self.script), "--dir", str(self.tmp), "--hold", str(HOLD),
               "--hold-world", str(self.hold_world), "--steps", str(STEPS)]
        self.procs.append(subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT,
                                           env={**os.environ, "PYTHONUNBUFFERED": "1"}))

    def wait_held(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not (self.tmp / "held").exists():
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise AssertionError(f"step {HOLD} never held: {[p.poll() for p in self.procs]}")
            time.sleep(0.1)

    def round_rank(self, i: int) -> Optional[int]:
        path = self.tmp / f"events{i}.jsonl"
        joined = [json.loads(x) for x in path.read_text().splitlines() if '"round_joined"' in x]
        return int(joined[-1]["fields"]["rank"]) if joined else None

    def finish(self, timeout: float = 180) -> list[str]:
        outs = []
        for p in self.procs:
            try:
                outs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append(p.communicate()[0])
        return outs

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def check_restored(tmp: Path, world: int, out: str) -> None:
    recs = [json.loads(x) for x in (tmp / "record.jsonl").read_text().splitlines()]
    last = [r for r in recs if r["held"] and r["world"] == world]
    assert sorted(r["rank"] for r in last) == list(range(world)), (recs, out[-3000:])
    assert {r["restored"] for r in last} == {HOLD}, (recs, out[-3000:])
    saved = torch.load(tmp / "saved.pt", weights_only=True)
    assert saved["step"] == HOLD
    for r in range(world):
        got = torch.load(tmp / f"restored-w{world}-r{r}.pt", weights_only=True)
        assert same(got, saved), f"rank {r} of {world} restored other weights than step {HOLD}'s"


def test_a_node_leaving_restores_every_rank_from_its_nodes_copy(tmp_path: Path) -> None:
    """3 -> 2: each survivor's agent holds its old rank's part of step HOLD (world 3)."""
    job = Agents(tmp_path, hold_world=3)
    try:
        for _ in range(3):
            job.start()
        job.wait_held()
        victim = next(i for i in range(3) if job.round_rank(i) == 2)
        os.kill(job.procs[victim].pid, signal.SIGKILL)
        outs = job.finish()
    finally:
        job.close()
    survivors = [o for i, o in enumerate(outs) if i != victim]
    assert [p.returncode for i, p in enumerate(job.procs) if i != victim] == [0, 0], \
        [o[-3000:] for o in survivors]
    text = "".join(survivors)
    check_restored(tmp_path, 2, text)
    assert text.count(f"restored step {HOLD} from local memory (rank ") == 2, text[-3000:]
    assert "world of 3)" in text


def test_a_node_joining_gets_the_step_from_a_holders_memory(tmp_path: Path) -> None:
    """2 -> 3: the two old nodes restore from their memory, the newcomer (whose agent holds
    nothing) receives the same bytes from the lowest holder over the process group."""
    job = Agents(tmp_path, hold_world=2)
    try:
        job.start()
        job.start()
        job.wait_held()
        job.start()
        outs = job.finish()
    finally:
        job.close()
    assert [p.returncode for p in job.procs] == [0, 0, 0], [o[-3000:] for o in outs]
    text = "".join(outs)
    check_restored(tmp_path, 3, text)
    assert text.count(f"restored step {HOLD} from local memory") == 2, text[-3000:]
    assert text.count(f"restored step {HOLD} from rank ") == 1, text[-3000:]
    assert "local memory (over the process group)" in text


# -- the pure parts ---------------------------------------------------------------------------
steps = st.lists(st.integers(0, 20), max_size=4)


@given(st.lists(st.tuples(steps, steps, st.booleans()), min_size=1, max_size=5))
def test_candidates_only_when_a_rank_has_no_part_and_only_newer_steps(
        ranks: list[tuple[list[int], list[int], bool]]) -> None:
    parts, slots, own = ([r[i] for r in ranks] for i in range(3))
    got = candidates(parts, slots, own)  # type: ignore[arg-type]
    if all(own):
        assert got == []
        return
    common = set(parts[0]).intersection(*map(set, parts[1:]))
    floor = max(common) if common else -1
    assert got == sorted({s for lst in slots for s in lst if s > floor}, reverse=True)


@given(st.lists(st.one_of(st.none(), st.sampled_from(["a", "b"])), min_size=1, max_size=6))
def test_pick_takes_one_content_or_none(digests: list[Optional[str]]) -> None:
    digest, holders = pick(digests)
    kinds = {d for d in digests if d is not None}
    if len(kinds) == 1:
        assert digest in kinds and holders == [r for r, d in enumerate(digests) if d == digest]
        assert holders and holders[0] == min(holders)
    else:  # nothing whole, or two different states called the same step: never a mix
        assert (digest, holders) == (None, [])


def test_the_content_digest_ignores_padding_and_sees_every_tensor_byte() -> None:
    state = {"objects": {"m": {"w": torch.arange(5.0), "b": torch.ones(3)}}, "values": {"step": 2}}
    plan = codec.Plan(state)
    a, b = bytearray(plan.size), bytearray(b"\xff" * plan.size)  # different padding
    plan.write(memoryview(a))
    plan.write(memoryview(b))
    assert a != b and content_digest(memoryview(a)) == content_digest(memoryview(b))
    state["objects"]["m"]["b"][1] = 7.0
    codec.Plan(state).write(memoryview(b))
    assert content_digest(memoryview(a)) != content_digest(memoryview(b))


def test_sharded_state_at_another_world_size_says_memory_cannot_serve_it() -> None:
    state = {"objects": {}, "values": {"step": 9}}
    plan = codec.Plan(state)
    raw = bytearray(plan.size)
    plan.write(memoryview(raw))
    with Holder(1, 1 << 20) as h:
        region = Region(h.path, 0, h.region, h.memory, 1)
        try:
            region.adopt(9, memoryview(raw), 1, 3)  # rank 1 of a world of 3
            line = sharded_note(region, 0, 2, None)
            assert line is not None and "step 9 of rank 1 in a world of 3" in line
            assert "--snapshot local,disk" in line
            assert sharded_note(region, 0, 2, 9) is None  # the exact rule has it already
            assert sharded_note(region, 1, 3, None) is None  # its own part: no note
        finally:
            region.close()


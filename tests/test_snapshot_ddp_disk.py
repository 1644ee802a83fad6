"""DDP under ``run_elastic`` with the disk tier: every agent lost, the relaunch restores from disk.

docs/snapshots.md's DDP recipe (the bare module in the ``State``, the wrapper rebuilt in
``on_join``) under ``--recovery in-place --snapshot local,disk``: the first launch trains to step
``HOLD`` (the disk tier has step ``DISK`` complete), then its agent is SIGKILLed (the workers die
with it, the agent's memory too). The relaunch seeds its model differently, so only a restore
from disk gives the fault-free weights; both ranks must start at ``DISK`` (red without the disk
tier: they start at 0 from other weights).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
STEPS, HOLD, DISK = 8, 5, 4

JOB = r'''
import json, os, signal, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from elastictk import State, run_elastic

d, relaunch, hold = sys.argv[1], int(os.environ.get("RELAUNCH", "0")), int(os.environ.get("HOLD", "-1"))
torch.manual_seed(1234 + relaunch)      # the relaunch starts from other weights
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
state = State(model=model, optimizer=opt, step=0)
wrapped = {}

def on_join(state, ctx):
    wrapped["ddp"] = DDP(model)
    with open(os.path.join(d, "record.jsonl"), "a") as f:
        f.write(json.dumps({"rank": ctx.rank, "relaunch": relaunch, "start": state.step}) + "\n")

def train_step(state, ctx):
    if state.step == hold and not relaunch:
        state.flush()                   # step DISK is on disk (its save is done)
        dist.barrier()
        if ctx.rank == 0:
            open(os.path.join(d, "held"), "w").close()
        while True:
            signal.pause()              # until the agent is killed
    opt.zero_grad()
    wrapped["ddp"](torch.ones(2, 4) * (state.step + ctx.rank)).pow(2).sum().backward()
    opt.step()
    state.step += 1

ctx = run_elastic(state, train_step, steps=''' + str(STEPS) + r''', on_join=on_join)
if ctx.rank == 0:
    torch.save(model.state_dict(), os.path.join(d, f"final{relaunch}.pt"))
'''


def command(tmp: Path, tag: str) -> list[str]:
    return [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "1", "--recovery", "in-place", "--snapshot", "local,disk",
            "--snapshot-dir", str(tmp / f"ckpt-{tag}"), "--snapshot-every", str(DISK // 2),
            "--log-dir", str(tmp / f"logs-{tag}"), str(tmp / "job.py"), str(tmp / tag)]


def test_every_agent_lost_the_ddp_recipe_resumes_from_disk(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(JOB)
    for tag in ("ref", "kill"):
        (tmp_path / tag).mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ref = subprocess.run(command(tmp_path, "ref"), cwd=ROOT, capture_output=True, text=True,
                         timeout=180, env=env)
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-3000:]
    first = subprocess.Popen(command(tmp_path, "kill"), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, env={**env, "HOLD": str(HOLD)})
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "kill" / "held").exists():
            assert first.poll() is None and time.monotonic() < deadline, "step HOLD never held"
            time.sleep(0.1)
        os.kill(first.pid, signal.SIGKILL)  # the agent; its workers die with it
        first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    again = subprocess.run(command(tmp_path, "kill"), cwd=ROOT, capture_output=True, text=True,
                           timeout=180, env={**env, "RELAUNCH": "1"})
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "kill" / "record.jsonl").read_text().splitlines()]
    assert {r["start"] for r in recs if r["relaunch"]} == {DISK}, (recs, out[-3000:])
    assert out.count(f"restored step {DISK} from disk") == 2, out[-3000:]
    got = torch.load(tmp_path / "kill" / "final1.pt", weights_only=True)
    want = torch.load(tmp_path / "ref" / "final0.pt", weights_only=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)

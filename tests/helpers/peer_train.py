"""A tiny gloo training job for the peer tier's end-to-end tests (tests/test_snapshot_peer.py).

``peer_train.py OUT STEPS``: one worker per node; every step commits the state. The first
start of a rank seeds the model with 0; any later start (a restart, or a spare taking a lost
host's rank) seeds it randomly, so only a restore can give the fault-free weights. The state
also holds one tensor of the rank's own (``mine``: rank r adds ``(r + 1) * step`` each step,
random at a later start), so a rank restored from another rank's copy ends with the wrong
value: only its own part, from its own memory or a peer's replica, gives the fault-free one.
Each rank writes its last step to ``OUT/step-<rank>`` (the test kills a host once both passed
a step), rank 0 writes the final weights and every rank's ``mine`` to ``OUT/weights.pt``, and
every start of a rank appends the step it restored to ``OUT/restored-<rank>`` (a job may
restart more than once under load: the test reads the first start after its fault). Every
rank holds after step 10 until ``OUT/go`` exists: a test that kills a host there, whatever the
machine's load, before the job can end; one that kills a host while the job commits creates
``OUT/go`` first.
"""
from __future__ import annotations

import os
import secrets
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from elastictk import State

out, steps = Path(sys.argv[1]), int(sys.argv[2])
HOLD = 10
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
marker = out / f"started-{rank}"
later = marker.exists()
torch.manual_seed(secrets.randbits(31) if later else 0)
marker.touch()
model = torch.nn.Linear(4, 1)
for p in model.parameters():
    dist.broadcast(p.data, 0)  # one initial model, whatever each rank drew
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
state = State(model=model, optimizer=opt, step=0,
              mine=torch.rand(1, dtype=torch.float64) if later else torch.zeros(1, dtype=torch.float64))
restored = state.restore()
with open(out / f"restored-{rank}", "a") as f:  # one line per start: "<wall time> <step or None>"
    f.write(f"{time.time()} {restored}\n")
while state.step < steps:
    opt.zero_grad()
    model(torch.ones(2, 4) * (state.step % 5) * 0.1).pow(2).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    state.step += 1
    state.mine = state.mine + (rank + 1) * state.step
    state.commit()
    (out / f"step-{rank}.tmp").write_text(str(state.step))
    os.replace(out / f"step-{rank}.tmp", out / f"step-{rank}")
    while state.step == HOLD and not (out / "go").exists():
        time.sleep(0.05)
    time.sleep(0.15)
mine = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
dist.all_gather(mine, state.mine)
if rank == 0:
    torch.save([p.detach().clone() for p in model.parameters()] + mine, out / "weights.pt")
dist.destroy_process_group()

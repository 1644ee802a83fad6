"""A DDP job over a DataLoader with 2 workers, for tests/test_data_e2e.py.

Every rank appends, after each committed step, the dataset indices it trained in that step
(``{"step", "epoch", "rank", "restart", "indices"}``) to ``--record``; the test rebuilds the
final history from step numbers. ``--sampler elastic`` uses ``ElasticSampler`` in the State;
``--sampler distributed`` uses torch's ``DistributedSampler`` and keeps only the epoch in the
State (the data position a per-epoch checkpoint has). On its first attempt, rank 1 SIGKILLs
itself after training step ``--kill``, before committing it
(the step is redone after the restore); under elastictk-chaos the plan's step faults fire at
the same point (``fault_point(step)``, the job's step). The model is seeded by the restart count, so only a
restore gives the fault-free weights.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DistributedSampler

from elastictk import State
from elastictk.data import DataLoader, ElasticSampler
from elastictk.faults import fault_point


class Numbers(Dataset):
    """Sample i: its index, an input and a target that depend on i only."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return i, torch.randn(4, generator=g), torch.randn(1, generator=g)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--record", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--sampler", choices=("elastic", "distributed"), default="elastic")
    p.add_argument("--samples", type=int, default=44)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--kill", type=int, default=-1)
    p.add_argument("--step-time", type=float, default=0.0, help="seconds to sleep after each step")
    p.add_argument("--hold-at", metavar="STEP:WORLD", default="0:0",
                   help="after committing STEP in a world smaller than WORLD, train no further: wait "
                        "for the agents to re-form the group with a joining node (an event, where a "
                        "job length would be a guess of the node's start-up on a loaded host)")
    a = p.parse_args()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    hold_step, hold_world = (int(x) for x in a.hold_at.split(":"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + restart)
    model = torch.nn.Linear(4, 1)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ds = Numbers(a.samples)
    if a.sampler == "elastic":
        sampler: ElasticSampler | DistributedSampler = ElasticSampler(ds, seed=7, batch_size=a.batch)
        state = State(model=model, optimizer=opt, sampler=sampler, step=0)
    else:
        sampler = DistributedSampler(ds, seed=7)
        state = State(model=model, optimizer=opt, step=0, epoch=0)
    loader = DataLoader(ds, batch_size=a.batch, sampler=sampler, num_workers=2)
    state.restore()
    fault_point(state.step)  # the job's step numbers are the fault plan's (and the first one recorded)
    first = sampler.epoch if isinstance(sampler, ElasticSampler) else state.epoch
    with open(a.record, "a") as rec:
        for epoch in range(first, a.epochs):
            sampler.set_epoch(epoch)
            for idx, x, y in loader:
                opt.zero_grad()
                (ddp(x) - y).pow(2).mean().backward()
                opt.step()
                state.step += 1
                rec.write(json.dumps({"step": state.step, "epoch": epoch, "rank": rank, "world": world,
                                      "restart": restart, "indices": idx.tolist()}) + "\n")
                rec.flush()
                if restart == 0 and state.step == a.kill and rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)  # trained, not committed: redone
                fault_point(state.step)  # a chaos plan's step faults: trained, not committed
                state.commit()
                if a.step_time:
                    time.sleep(a.step_time)
                while state.step >= hold_step and world < hold_world:
                    time.sleep(0.1)  # until the agent stops this worker to re-form the group
            if a.sampler == "distributed":
                state.epoch = epoch + 1  # a checkpoint per epoch: the next epoch starts there
    if rank == 0:
        torch.save(model.state_dict(), a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

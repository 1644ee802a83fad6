"""Training under elastictk's snapshots that ends cleanly on Slurm's pre-emption warning.

SIGUSR1 (forwarded by the agent) sets a flag; every step the ranks agree on it (an all_reduce
of MAX), so all of them stop after committing the same step; ``destroy_process_group`` then
writes that newest commit to the disk tier. Rank 0 writes ``progress`` (the step committed),
``stopped`` (the step it ended at) and ``restored`` (what ``restore()`` returned) into OUT.

    preempt_train.py OUT [--steps N]
"""
from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

from elastictk import State

warned = False


def _warned(_sig: int, _frame: object) -> None:
    global warned
    warned = True


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args()
    signal.signal(signal.SIGUSR1, _warned)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = State(model=model, optimizer=opt, step=0)
    restored = state.restore()
    if rank == 0:
        with open(os.path.join(args.out, "restored"), "a") as f:
            f.write(f"{restored}\n")
    while state.step < args.steps:
        opt.zero_grad()
        model(torch.ones(2, 4) * state.step).pow(2).sum().backward()
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
        opt.step()
        state.step += 1
        state.commit()
        if rank == 0:
            with open(os.path.join(args.out, "progress"), "w") as f:
                f.write(str(state.step))
        flag = torch.tensor([1 if warned else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            break
        time.sleep(0.05)
    if rank == 0:
        with open(os.path.join(args.out, "stopped"), "w") as f:
            f.write(f"{state.step} {model.weight.detach().sum().item()!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

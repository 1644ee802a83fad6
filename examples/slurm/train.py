"""A training script that ends cleanly on Slurm's pre-emption warning (train.sbatch runs it).

``elastictk-run`` forwards the warning (SIGUSR1, ``sbatch --signal=USR1@120``) to every worker;
here it only sets a flag. Each step the ranks agree on the flag (an all_reduce of MAX: one
int per step), so all of them stop after committing the same step, and
``destroy_process_group`` writes that newest commit to the disk tier (``--snapshot-dir``). The
requeued job's ``state.restore()`` resumes from it. With ``--out DIR``, rank 0 writes there the
step committed (``progress``), the step it ended at and its weights (``stopped``) and what
``restore()`` returned (``restored``): tests/test_slurm_preempt.py reads them.

    elastictk-run --snapshot local,disk --snapshot-dir DIR train.py [--steps N] [--out DIR]
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


def note(out: str | None, rank: int, name: str, text: str, mode: str = "w") -> None:
    if out is not None and rank == 0:
        with open(os.path.join(out, name), mode) as f:
            f.write(text)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
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
    note(args.out, rank, "restored", f"{restored}\n", mode="a")
    while state.step < args.steps:
        opt.zero_grad()
        x = torch.ones(2, 4) * (state.step % 4 + 1) / 4  # bounded inputs: the weights stay finite
        (model(x) - 1).pow(2).sum().backward()
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
        opt.step()
        state.step += 1
        state.commit()
        note(args.out, rank, "progress", str(state.step))
        flag = torch.tensor([1 if warned else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            break
        time.sleep(0.05)
    note(args.out, rank, "stopped", f"{state.step} {model.weight.detach().sum().item()!r}")
    if rank == 0:
        print(f"{'pre-empted' if warned else 'finished'} at step {state.step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

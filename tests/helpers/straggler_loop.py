"""A gloo loop (``dist.all_reduce`` of the gradients, or ``--ddp``) with no elastictk calls whose rank ``--slow-rank`` spends ``--slow`` extra seconds
of its own per step (a straggler) before the step's all_reduce; ``--steps`` steps of about
``--step-time`` seconds of own work each."""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--ddp", action="store_true", help="DistributedDataParallel, no Python all_reduce")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model: torch.nn.Module = torch.nn.Linear(4, 1)
    if args.ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(args.steps):
        time.sleep(args.step_time + (args.slow if rank == args.slow_rank else 0.0))
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for q in model.parameters() if not args.ddp else ():
            dist.all_reduce(q.grad)
        opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

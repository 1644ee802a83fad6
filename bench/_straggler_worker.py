"""The stragglers benchmark's worker: a gloo loop with a fault checkpoint at the top of each step.

    _straggler_worker.py OUT_DIR [--step-time T] [--mark-at K] [--max-steps N]

Each step: ``elastictk.faults.fault_point(step)`` (where the plan's ``slow:<s>`` faults sleep),
``T`` seconds of the rank's own work, a tiny model's gradients all-reduced, a stop flag
all-reduced (every rank stops at the same step once ``OUT_DIR/stop`` exists), an optimizer step
(the agent's step timing counts optimizer steps). Rank 0 writes ``OUT_DIR/mark`` holding
``time.monotonic()`` when it reaches step ``K``: the control run's "the straggler would start
now", as the fault log's first ``slow`` line is the faulted runs'.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import elastictk.faults


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--mark-at", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=5000)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stop = os.path.join(args.out, "stop")
    for step in range(args.max_steps):
        if rank == 0 and step == args.mark_at:
            with open(os.path.join(args.out, "mark"), "w") as f:
                f.write(f"{time.monotonic():.6f}\n")
        elastictk.faults.fault_point(step)
        time.sleep(args.step_time)
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for q in model.parameters():
            dist.all_reduce(q.grad)
        flag = torch.tensor([1.0 if os.path.exists(stop) else 0.0])
        dist.all_reduce(flag)
        opt.step()
        if flag.item() > 0:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

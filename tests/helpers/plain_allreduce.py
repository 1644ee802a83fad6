"""A plain torchrun-style gloo training loop with no elastictk calls at all: a tiny linear
model, gradients averaged with ``dist.all_reduce``, an SGD step, a ``step N`` line per step.
Checkpoints with ``torch.save`` (``--ckpt-dir``) so a restarted attempt resumes.

    torchrun --nproc-per-node 2 plain_allreduce.py --steps 12 --ckpt-dir /tmp/ck
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--print-every", type=int, default=1, help="a step line every N steps")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0
    ckpt = os.path.join(args.ckpt_dir, "plain.pt") if args.ckpt_dir else None
    if ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(8, 4, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for q in model.parameters():
            dist.all_reduce(q.grad)
            q.grad /= world
        opt.step()
        time.sleep(args.step_time)
        if (step + 1) % args.print_every == 0:
            print(f"[rank {rank}] step {step + 1}", flush=True)
        if ckpt and rank == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"step": step + 1, "model": model.state_dict(), "opt": opt.state_dict()},
                       ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    dist.barrier()
    w = torch.cat([q.detach().flatten() for q in model.parameters()])
    if rank == 0:
        print(f"final checksum {float(w.sum()):.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A plain DDP script with no elastictk calls: ``DistributedSampler`` + ``DataLoader`` over a
tiny in-memory dataset, ``DistributedDataParallel`` on gloo (its gradient all_reduces run in
C++), and ``torch.save`` of model and optimizer at the end of every epoch (resumed from, so a
restarted attempt goes on from its last epoch).

    torchrun --nproc-per-node 2 ddp_save.py --epochs 4 --ckpt-dir /tmp/ck
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--ckpt-dir", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)  # 4 steps per epoch on 2 ranks
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = os.path.join(args.ckpt_dir, "ddp.pt")
    epoch0 = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        epoch0 = state["epoch"]
    step = epoch0 * len(loader)
    for epoch in range(epoch0, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            time.sleep(args.step_time)
            print(f"[rank {rank}] step {step}", flush=True)
        if rank == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"epoch": epoch + 1, "model": model.module.state_dict(),
                        "opt": opt.state_dict()}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()
    if rank == 0:
        w = torch.cat([q.detach().flatten() for q in model.module.parameters()])
        print(f"final checksum {float(w.sum()):.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

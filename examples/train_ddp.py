"""A plain torchrun-style DDP training script: no elastictk import anywhere.

``DistributedDataParallel`` over a small ``nn.Module`` on gloo (CPU), a ``DistributedSampler`` +
``DataLoader`` over a synthetic dataset, and a ``torch.save`` checkpoint at the end of every
epoch: rank 0 writes it (atomically), every rank loads it when the job starts again, so a
restarted group goes on from its last finished epoch. It is the shape most real jobs have, and
unlike ``examples/train.py`` it never calls a collective from Python (DDP's gradient all_reduces
run in C++) nor reports its steps: ``elastictk-chaos`` counts its ``optimizer.step()`` calls.

    torchrun --nproc-per-node 2 examples/train_ddp.py --epochs 3 --ckpt-dir /tmp/ddp
    elastictk-run --nproc-per-node 2 --max-restarts 3 examples/train_ddp.py --ckpt-dir /tmp/ddp

Same data, same seed and same world size give the same final checksum, with or without restarts
in between (an attempt resumes at an epoch boundary, and the sampler's order depends only on the
epoch).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def dataset(samples: int) -> TensorDataset:
    """A fixed synthetic regression task: the same tensors in every process and attempt."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 8, generator=g)
    y = (x * torch.linspace(-1, 1, 8)).sum(dim=1, keepdim=True) + 0.1 * torch.randn(samples, 1, generator=g)
    return TensorDataset(x, y)


def checksum(model: torch.nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--samples", type=int, default=64, help="dataset size (default 64)")
    p.add_argument("--batch-size", type=int, default=8, help="per rank (default 8)")
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step (default 0.05)")
    p.add_argument("--ckpt-dir", required=True)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = dataset(args.samples)
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    model = DistributedDataParallel(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    ckpt = os.path.join(args.ckpt_dir, "ddp.pt")
    start = 0
    if os.path.exists(ckpt):  # every rank loads the same file rank 0 wrote
        state = torch.load(ckpt, map_location="cpu")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["epoch"]
        if rank == 0:
            print(f"resumed from epoch {start}", flush=True)
    step = start * len(loader)
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()  # DDP all-reduces the gradients here, from C++
            opt.step()
            step += 1
            if args.step_time:
                time.sleep(args.step_time)
            if rank == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
        if rank == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            tmp = f"{ckpt}.tmp"
            torch.save({"epoch": epoch + 1, "model": model.module.state_dict(), "opt": opt.state_dict()}, tmp)
            os.replace(tmp, ckpt)  # a rank killed mid-save never leaves a torn checkpoint
        dist.barrier()  # nobody starts the next epoch before its checkpoint exists
    if rank == 0:
        print(f"final checksum {checksum(model.module)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

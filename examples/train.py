"""A small, deterministic data-parallel training job that survives restarts.

Written for torchrun: it reads only the standard environment (RANK, WORLD_SIZE, MASTER_ADDR,
TORCHELASTIC_RESTART_COUNT...), so it runs unchanged under ``torchrun`` and ``elastictk-run``.
Every sample is generated from its global index, gradients are all-reduced with gloo, and rank 0
checkpoints atomically every ``--ckpt-every`` steps; a restarted group resumes from the last
checkpoint and ends with the same weights, and the same checksum, as a run without faults.

    elastictk-run --nproc-per-node 4 --max-restarts 3 examples/train.py --steps 60 --ckpt-dir /tmp/ck
"""
from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

try:  # step counts and goodput for elastictk-run --metrics-port; a no-op anywhere else
    import elastictk.metrics as etm
except ImportError:  # pragma: no cover - the script also runs where elastictk is not installed
    etm = None
try:  # step-exact faults of an elastictk-chaos run; a no-op without a fault plan
    from elastictk.faults import fault_point
except ImportError:  # pragma: no cover
    def fault_point(step: int) -> None:
        pass

FEATURES = 16
GLOBAL_BATCH = 32


def samples(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of the global batch of ``step``; independent of who ran it before."""
    per_rank = GLOBAL_BATCH // world
    xs, ys = [], []
    for i in range(rank * per_rank, (rank + 1) * per_rank):
        g = torch.Generator().manual_seed(step * GLOBAL_BATCH + i)
        x = torch.randn(FEATURES, generator=g, dtype=torch.float64)
        xs.append(x)
        ys.append((x * torch.arange(FEATURES, dtype=torch.float64)).sum().reshape(1))
    return torch.stack(xs), torch.stack(ys)


def checksum(model: torch.nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def save(path: str, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, tmp)
    os.replace(tmp, path)  # a worker killed mid-save never leaves a torn checkpoint


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.02, help="extra seconds per step, to make the job long enough to hit")
    p.add_argument("--crash", action="append", default=[],
                   help="STEP:RANK[:SIGNAL] crash this rank at this step, in the first attempt only")
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    ckpt = os.path.join(args.ckpt_dir, "checkpoint.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        print(f"[rank {rank}] resumed at step {start} (attempt {attempt})", flush=True)
    crashes = {}
    for spec in args.crash:
        parts = spec.split(":")
        crashes[(int(parts[0]), int(parts[1]))] = parts[2] if len(parts) > 2 else "SIGKILL"

    for step in range(start, args.steps):
        fault_point(step + 1)  # the step about to run, as the "step N" lines count
        if attempt == 0 and (step, rank) in crashes:
            sig = crashes[(step, rank)]
            print(f"[rank {rank}] injected {sig} at step {step}", flush=True)
            if sig == "exception":
                raise RuntimeError(f"injected failure at step {step}")
            os.kill(os.getpid(), getattr(signal, sig))
        x, y = samples(step, rank, world)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum") / GLOBAL_BATCH
        loss.backward()
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
        opt.step()
        if args.step_time:
            time.sleep(args.step_time)
        print(f"[rank {rank}] step {step + 1} loss {loss.item() * world:.6f}", flush=True)
        if etm is not None:
            etm.step()
        if rank == 0 and (step + 1) % args.ckpt_every == 0:
            save(ckpt, step + 1, model, opt)
        if etm is not None and (step + 1) % args.ckpt_every == 0:
            etm.checkpoint()  # every rank: the steps so far survive a restart
    dist.barrier()
    if rank == 0:
        print(f"final checksum {checksum(model)} after {args.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

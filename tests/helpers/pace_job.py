"""A 2-rank DDP job (gloo, CPU) with a long eval, for the learned hang deadlines.

Usage: pace_job.py OUT_DIR STEPS EVAL_S [MODE AT]. It trains STEPS/2 steps of 0.05 s, then
evaluates for EVAL_S seconds (an ``all_reduce`` of its metrics every 0.5 s, no optimizer step),
then trains STEPS/2 more. No elastictk call: progress is seen through the optimizer hook and
the wrapped collectives only. Each rank writes ``a<attempt>.r<rank>.first`` (the monotonic
time of its first step), ``a<attempt>.r<rank>.eval`` (the eval's start and end) and
``a<attempt>.r<rank>.done``. MODE, in attempt 0, at step AT (after warm-up):

- ``freeze``: rank 1 writes ``fault`` (its PID and the monotonic time) and SIGSTOPs itself;
- ``skip``: rank 1 writes ``fault`` and sleeps instead of the next ``all_reduce`` that rank 0
  makes (a collective its peer never joins);
- ``skip-ddp``: the same with rank 0 in its next DDP backward (the C++ all-reduce);
- ``stall``: both ranks write ``fault.r<rank>`` and sleep 12 s outside any collective (a phase
  without progress that is no hang: reported, not killed).
"""
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

out, steps, eval_s = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
mode, at = (sys.argv[4], int(sys.argv[5])) if len(sys.argv) > 5 else ("", -1)
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
tag = f"a{attempt}.r{rank}"
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
metric = torch.zeros(1)


def fault_here(i: int) -> bool:
    if attempt != 0 or i != at or not mode:
        return False
    if mode == "stall":
        (out / f"fault.r{rank}").write_text(f"{os.getpid()} {time.monotonic()}")
        time.sleep(12)
        return False
    if rank == 1:
        (out / "fault").write_text(f"{os.getpid()} {time.monotonic()}")
        if mode == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(3600)  # never joins rank 0's next collective
    elif mode == "skip":
        dist.all_reduce(metric)  # rank 1 never joins this one
    return False


def train(first: int, n: int) -> None:
    for i in range(first, first + n):
        fault_here(i)
        loss = model(torch.randn(8, 4)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i == 0:
            (out / f"{tag}.first").write_text(str(time.monotonic()))
        time.sleep(0.05)


train(0, steps // 2)
start = time.monotonic()
while time.monotonic() - start < eval_s:  # eval: collectives, no optimizer step
    metric += 1
    dist.all_reduce(metric)
    time.sleep(0.5)
(out / f"{tag}.eval").write_text(f"{start} {time.monotonic()}")
train(steps // 2, steps - steps // 2)
(out / f"{tag}.done").write_text("ok")
dist.destroy_process_group()

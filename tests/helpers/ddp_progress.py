"""A plain DDP loop (gloo, CPU, an nn.Linear) with no elastictk calls, for the progress watchdog.

Usage: ddp_progress.py OUT_DIR STEPS PAUSE_S [STALL_S]. With STALL_S, rank 1 of the first
attempt sleeps that long before joining the process group (a startup hang). Each rank writes ``a<attempt>.r<rank>.pid`` into
OUT_DIR after its third step (the test's cue to freeze it), ``a<attempt>.r<rank>.timeout`` with
its process group's timeout in seconds, and ``a<attempt>.r<rank>.done`` at the end. Steps are
counted by elastictk only through torch's optimizer step hook.
"""
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

out, steps, pause = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
stall = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
if stall and os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    time.sleep(stall)
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
(out / f"a{attempt}.r{rank}.timeout").write_text(str(timeout.total_seconds()))
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(steps):
    loss = model(torch.randn(8, 4)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if i == 2:
        (out / f"a{attempt}.r{rank}.pid").write_text(str(os.getpid()))
    time.sleep(pause)
(out / f"a{attempt}.r{rank}.done").write_text("ok")
dist.destroy_process_group()

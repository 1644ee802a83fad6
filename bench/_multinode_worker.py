"""The multinode benchmark's worker: a gloo all-reduce per step, one log line per step.

    _multinode_worker.py OUT_DIR

Appends ``<monotonic> <WORLD_SIZE> <RANK> <pid>`` to ``OUT_DIR/steps.log`` after every step (the
monotonic clock is the kernel's, the same in every network namespace of this machine; the pid
tells a step of a job re-formed after a lost node from a late line of the old one), and
stops, with every rank, once ``OUT_DIR/stop`` exists. The all-reduce is what makes a lost
host visible to torchrun: its agent learns of a dead peer only when a collective fails.
"""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world, pid = dist.get_rank(), dist.get_world_size(), os.getpid()
    fd = os.open(os.path.join(out, "steps.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    stop = os.path.join(out, "stop")
    try:
        while True:
            flag = torch.tensor([1.0 if os.path.exists(stop) else 0.0])
            dist.all_reduce(flag)
            if flag.item() > 0:
                break
            os.write(fd, f"{time.monotonic():.6f} {world} {rank} {pid}\n".encode())
            time.sleep(0.05)
    finally:
        os.close(fd)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

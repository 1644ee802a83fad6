"""A training-shaped worker whose ranks talk to each other once, to start together (a gloo
barrier), and never again: it prints ``[rank R] step N`` lines (what elastictk-chaos counts),
calls the fault checkpoint each step and exits 0.

Why not examples/train.py: a gloo job that loses a node sees a worker fail in its next
collective before the agents see the missing heartbeat, so the loss is charged as a failure.
Without collectives the survivors' agents see the loss first, as a membership change; the
multi-node chaos tests need both paths.

    chaos_steps_worker.py --steps 40 --step-time 0.1 [--hold-below-world 2]
"""
from __future__ import annotations

import argparse
import os
import time

import torch.distributed as dist

import elastictk.faults


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--hold-below-world", type=int, default=0, metavar="N",
                   help="in a world of fewer than N ranks, take no step: wait for the agents to "
                        "re-form with the missing nodes (a node's start-up is seconds idle and a "
                        "minute on a loaded host: a job length cannot be chosen to outlast it)")
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    # Start together: nodes spawn their workers seconds apart on a loaded machine, and a rank
    # that finished alone would wait in its agent's exit barrier, not watch for lost nodes.
    dist.init_process_group("gloo")
    dist.barrier()
    while world < args.hold_below_world:
        time.sleep(0.1)  # until the agent stops this worker to re-form the group
    for step in range(args.steps):
        elastictk.faults.fault_point(step + 1)
        time.sleep(args.step_time)
        print(f"[rank {rank}] step {step + 1}", flush=True)
    os._exit(0)  # no teardown collective with peers that may be gone


if __name__ == "__main__":
    main()

"""One node's worker for ``bench snapshot``'s memory figures, in a process of its own.

``python -m bench._snap_node SIZE STEPS``: builds a state of SIZE bytes (parameters and SGD
momentum, half each), then trains STEPS steps of 100 ms, committing every step with
``--snapshot local --snapshot-overlap 1`` into the snapshot memory its agent (the environment)
names; the agent ships every sealed slot to its peer. Prints ``ready`` once the state is built
(the bench reads the baseline then) and ``done STEP`` at the end.
"""
from __future__ import annotations

import sys
import time


def main() -> None:
    import torch

    from elastictk import State

    size, steps = int(sys.argv[1]), int(sys.argv[2])
    n = size // 8
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(n))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.w.grad = torch.ones(n)
    opt.step()
    state = State(model=model, optimizer=opt, step=0, snapshot="local", snapshot_overlap=True)
    print("ready", flush=True)
    sys.stdin.readline()  # the bench has read the baseline
    for _ in range(steps):
        time.sleep(0.1)  # forward and backward
        opt.step()
        state.step += 1
        state.commit()
    state.flush()
    print(f"done {state.step}", flush=True)
    sys.stdin.readline()  # the bench has seen the last replica arrive


if __name__ == "__main__":
    main()

"""examples/train.py's job on elastictk's in-place recovery: a dead rank is replaced, the rest
keep their processes, and nobody reads a checkpoint.

The same model, data and optimizer as ``train.py`` (so a fault-free run of either prints the
same final checksum), driven by ``elastictk.run_elastic``: the state is committed in memory
after every step; when a peer dies the survivors roll back to the last commit, re-form their
process group with the replacement, and send it the state over the group::

    elastictk-run --standalone --nproc-per-node 4 --max-restarts 3 --recovery in-place \\
        examples/train_inplace.py --steps 60 --crash 12:2

Under torchrun, or elastictk-run's default restart-all, it runs too, without recovery (a
failure ends the attempt and the job starts over: this example keeps no checkpoint).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import FEATURES, GLOBAL_BATCH, checksum  # noqa: E402  (same model and data)

from elastictk.inplace import State, run_elastic  # noqa: E402
from elastictk.inplace.loop import Context  # noqa: E402


def batch(step: int, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of ``step`` at these global indices; who holds them does not matter."""
    xs, ys = [], []
    for i in indices:
        g = torch.Generator().manual_seed(step * GLOBAL_BATCH + i)
        x = torch.randn(FEATURES, generator=g, dtype=torch.float64)
        xs.append(x)
        ys.append((x * torch.arange(FEATURES, dtype=torch.float64)).sum().reshape(1))
    return torch.stack(xs), torch.stack(ys)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--crash", action="append", default=[],
                   help="STEP:RANK[:SIGNAL] the first process of this rank kills itself at this "
                        "step (SIGSTOP freezes it instead: a hang)")
    p.add_argument("--crash-at-start", metavar="K:PATH",
                   help="once per job (PATH marks that it happened): a process started with "
                        "TORCHELASTIC_RESTART_COUNT=K is SIGKILLed before it joins (a replacement "
                        "that dies while its generation forms: the agent falls back to restart-all)")
    p.add_argument("--record", help="append one JSON line per group formation to this file")
    p.add_argument("--trace", help="append one JSON line per step and rank (the global sample "
                   "indices it trained on) and, from rank 0, the final weights")
    p.add_argument("--until-world", metavar="W:K",
                   help="end K steps after the world first reaches W ranks (or at --steps): a job "
                        "as long as a joining node needs, on any host, not a guess of its start-up")
    p.add_argument("--ckpt-dir", help="ignored (accepted so train.py's command lines work)")
    p.add_argument("--ckpt-every", type=int, help="ignored")
    args = p.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = State(model=model, optimizer=opt, step=0)
    first_process = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    crashes = {}
    for spec in args.crash:
        parts = spec.split(":")
        crashes[(int(parts[0]), int(parts[1]))] = parts[2] if len(parts) > 2 else "SIGKILL"

    want_world, _, more = (args.until_world or "0:0").partition(":")
    grown_at: list[int] = []  # the step at which the world first had want_world ranks

    def on_join(state: State, ctx: Context) -> None:
        if args.until_world and not grown_at and ctx.world_size >= int(want_world):
            grown_at.append(int(state.step))  # every rank of this generation joins at this step
        if ctx.generation > 0:
            # The line train.py prints after loading its checkpoint; here the state came from
            # memory (rolled back) or from a peer (a replacement).
            print(f"[rank {ctx.rank}] resumed at step {state.step} (attempt {ctx.generation})",
                  flush=True)
        if args.record:
            with open(args.record, "a") as f:
                f.write(json.dumps({"rank": ctx.rank, "pid": os.getpid(), "gen": ctx.generation,
                                    "step": state.step, "world": ctx.world_size,
                                    "restart_count": ctx.restart_count}) + "\n")

    def train_step(state: State, ctx: Context) -> None:
        step = state.step
        if first_process and (step, ctx.rank) in crashes:
            sig = crashes.pop((step, ctx.rank))
            print(f"[rank {ctx.rank}] injected {sig} at step {step}", flush=True)
            os.kill(os.getpid(), getattr(signal, sig))
        x, y = batch(step, ctx.shard(GLOBAL_BATCH))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum") / GLOBAL_BATCH
        loss.backward()
        if args.trace:
            # Logged before the all_reduce, not after: once this rank's gradient is in the sum its
            # peers may commit the step, and a rank killed between the sum and a later write would
            # leave a committed step that looks as if its samples were never trained.
            part = ctx.shard(GLOBAL_BATCH)
            with open(args.trace, "a") as f:
                f.write(json.dumps({"step": step, "gen": ctx.generation, "rank": ctx.rank,
                                    "world": ctx.world_size, "pid": os.getpid(),
                                    "samples": [part.start, part.stop]}) + "\n")
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
        opt.step()
        if args.step_time:
            time.sleep(args.step_time)
        print(f"[rank {ctx.rank}] step {step + 1} loss {loss.item() * ctx.world_size:.6f}", flush=True)
        state.step = step + 1

    if args.crash_at_start:
        count, _, marker = args.crash_at_start.partition(":")
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == count:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                print(f"[rank {os.environ.get('RANK')}] injected SIGKILL at start", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    def done(s: State) -> bool:
        return int(s.step) >= args.steps or bool(grown_at and int(s.step) >= grown_at[0] + int(more))

    ctx = run_elastic(state, train_step, done=done, on_join=on_join)
    if ctx.rank == 0:
        print(f"final checksum {checksum(model)} after {int(state.step)} steps", flush=True)
        if args.trace:
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            with open(args.trace, "a") as f:
                f.write(json.dumps({"final": flat.tolist()}) + "\n")


if __name__ == "__main__":
    main()

"""``make demo``, part 3: a restart-all job SIGKILLed mid-step resumes from memory.

1. Runs a 2-worker job (``--worker`` mode of this file: ``State(model, optimizer, step)``,
   ``state.restore()`` at the start, ``state.commit()`` after every step) under
   ``elastictk-run --snapshot local`` without faults: the reference weights.
2. Runs it again and SIGKILLs rank 1 from outside in the middle of a step. The agent restarts
   both workers (restart-all); they restore the newest step both ranks had committed from the
   agent's memory, no checkpoint file anywhere.
3. Checks: the job resumed from the newest step every rank had committed (no step lost but
   the one in flight: a step one rank committed and the killed one had not is run again), and
   ended with the fault-free weights.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

STEPS = 40
STEP_TIME = 0.05


def worker(steps: int) -> None:
    """The training job: what a user writes (plus the prints this demo reads)."""
    import torch
    import torch.distributed as dist

    from elastictk import State

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = State(model=model, optimizer=opt, step=0)
    restored = state.restore()  # None on a first start
    if restored is not None:
        print(f"[rank {rank}] resumed at step {restored}", flush=True)
    while state.step < steps:
        g = torch.Generator().manual_seed(state.step * world + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        time.sleep(STEP_TIME)  # the step's compute: where the kill lands
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        state.step += 1
        state.commit()
        print(f"[rank {rank}] committed step {state.step}", flush=True)
    if rank == 0:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()
        print(f"final weights sha256 {hashlib.sha256(flat).hexdigest()[:16]}", flush=True)


def run(label: str, tmp: str, steps: int, kill: bool) -> dict:
    print(f"\n=== {label} ===", flush=True)
    cmd = [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--snapshot", "local", "--log-dir", f"{tmp}/logs",
           __file__, "--worker", "--steps", str(steps)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    kill_after = steps * 3 // 8  # rank 0's committed steps before the demo kills rank 1
    got: dict = {"committed": {0: 0, 1: 0}, "resumed": set(), "weights": None, "restarts": 0}
    pids: dict[int, int] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if m := re.search(r"workers_started .*pids=\{0: (\d+), 1: (\d+)\}", line):
            pids = {0: int(m.group(1)), 1: int(m.group(2))}
        if m := re.search(r"\[rank (\d)\] committed step (\d+)", line):
            if not got["resumed"]:  # the first processes' lines (relayed by the agent, they
                # may come after its restart line, never after a restarted worker's)
                got["committed"][int(m.group(1))] = int(m.group(2))
            if kill and got["restarts"] == 0 and "killed" not in got and int(m.group(1)) == 0 \
                    and int(m.group(2)) >= kill_after:
                got["killed"] = dict(got["committed"])
                print(f"  >>> demo: SIGKILL rank 1 (pid {pids[1]}), rank 0 having committed "
                      f"step {got['committed'][0]}", flush=True)
                os.kill(pids[1], signal.SIGKILL)
            continue
        if "[elastictk-run] restart " in line:
            got["restarts"] += 1
        if m := re.search(r"resumed at step (\d+)", line):
            got["resumed"].add(int(m.group(1)))
        if m := re.search(r"final weights sha256 (\w+)", line):
            got["weights"] = m.group(1)
        if re.search(r"worker_failed|\] restart |restored step|resumed at|final weights|succeeded|failed", line):
            print("  " + line, flush=True)
    got["exit"] = proc.wait()
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=STEPS, help="at least 8")
    a = p.parse_args()
    if a.worker:
        worker(a.steps)
        return 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="elastictk-demo-snapshot-") as tmp:
        ref = run("snapshots: reference run, no faults", tmp, a.steps, kill=False)
        got = run("snapshots: the same job, rank 1 SIGKILLed mid-step, restart-all", tmp, a.steps,
                  kill=True)
    took = time.monotonic() - start
    print()
    # Rank 0's lines are complete (it is not the one killed); rank 1 may die between its commit
    # and its print, so the step both hold is what the restarted workers report.
    c0 = got["committed"][0]
    resumed = got["resumed"]
    step = min(resumed) if resumed else -1
    ok = (ref["exit"] == 0 and got["exit"] == 0 and got["restarts"] == 1 and "killed" in got
          and len(resumed) == 1 and 0 <= c0 - step <= 1 and ref["weights"] is not None
          and got["weights"] == ref["weights"])
    if ok:
        print(f"demo passed in {took:.0f}s: both workers restarted and resumed at step {step} "
              f"from the agent's memory, the newest step both had committed (run again: "
              f"{f'step {c0}, which rank 1 had not committed' if c0 > step else 'only the step in flight'}"
              f"); final weights {got['weights']}, the same as without the fault")
        return 0
    print(f"demo FAILED: reference exit {ref['exit']} weights {ref['weights']}; faulty run exit "
          f"{got['exit']}, {got['restarts']} restart(s), rank 0 committed step {c0}, resumed at "
          f"{sorted(resumed)}, weights {got['weights']}")
    return 1


if __name__ == "__main__":
    sys.exit(main())

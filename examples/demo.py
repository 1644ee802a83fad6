"""``make demo``: an elastic training job on CPU that survives injected faults, and proves it.

1. Runs examples/train.py under elastictk-run with 4 workers and no faults: the reference.
2. Runs it again with --max-restarts 3 while two workers die: rank 2 (or the last rank)
   SIGKILLs itself at step 12 (an injected crash), and this script SIGKILLs rank 1 from
   outside once the restarted group is training again.
3. Checks that the job finished, used exactly two restarts, and ended with the same
   checksum as the reference.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHOWN = re.compile(r"\[elastictk-run\] (worker_failed|restart|workers_started|job_finished|succeeded|failed)|injected|resumed|final checksum")


def run(label: str, args: list[str], kill_rank_after: int | None = None) -> tuple[int, str | None, int]:
    """Run one job; returns (exit code, final checksum, restarts seen).

    With one node, local rank = global rank, so the PIDs the agent logs are the ranks' PIDs.
    """
    print(f"\n=== {label} ===", flush=True)
    cmd = [sys.executable, "-m", "elastictk.run", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    checksum, restarts, killed = None, 0, False
    pids: dict[int, int] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if SHOWN.search(line):
            print("  " + line, flush=True)
        if m := re.search(r"final checksum (\w+)", line):
            checksum = m.group(1)
        if "[elastictk-run] restart " in line:
            restarts += 1
        if m := re.search(r"workers_started .*pids=(\{.*\})", line):
            pids = ast.literal_eval(m.group(1))  # local rank -> PID, as the agent reports them
        step = re.search(r"\[rank 0\] step (\d+)", line)
        if kill_rank_after is not None and not killed and restarts == 1 and step and int(step.group(1)) >= kill_rank_after:
            pid = pids.get(1)
            if pid is not None:
                print(f"  >>> demo: SIGKILL rank 1 (pid {pid}) from outside", flush=True)
                os.kill(pid, signal.SIGKILL)
                killed = True
    return proc.wait(), checksum, restarts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="elastictk-demo-") as tmp:
        common = ["--standalone", "--nproc-per-node", str(a.workers), "--log-dir", f"{tmp}/logs"]
        train = [str(HERE / "train.py"), "--steps", str(a.steps), "--step-time", "0.05"]
        rc0, ref, _ = run("reference run, no faults", [*common, *train, "--ckpt-dir", f"{tmp}/ck0"])
        rc1, got, restarts = run(
            "the same job with two workers killed",
            [*common, "--max-restarts", "3", *train, "--ckpt-dir", f"{tmp}/ck1", "--crash", f"12:{min(2, a.workers - 1)}:SIGKILL"],
            kill_rank_after=a.steps * 5 // 8,
        )
    took = time.monotonic() - start
    print()
    ok = rc0 == 0 and rc1 == 0 and ref is not None and got == ref and restarts == 2
    if ok:
        print(f"demo passed in {took:.0f}s: the job survived 2 worker deaths with 2 restarts "
              f"and ended with the fault-free checksum {ref}")
        return 0
    print(f"demo FAILED: reference exit {rc0} checksum {ref}; faulty run exit {rc1} checksum {got} "
          f"after {restarts} restart(s) (expected 2)")
    return 1


if __name__ == "__main__":
    sys.exit(main())

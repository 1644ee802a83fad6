"""In-place recovery, shown: survivors keep training, only the failed rank is replaced.

1. Runs examples/train_inplace.py under ``elastictk-run --recovery in-place`` with 4 workers and
   no faults: the reference checksum.
2. Runs it again while rank 2 SIGKILLs itself at step 12 (a crash), and this script SIGSTOPs
   rank 1 from outside once the job trains again (a hang: the others' collectives time out,
   the agent kills the frozen rank, and that becomes the second in-place recovery).
3. Checks that the job finished with two in-place recoveries and no restart of the group, that
   every survivor kept its PID, and that the final weights equal the reference's.

    python examples/demo_inplace.py [--workers 4] [--steps 40]
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHOWN = re.compile(r"\[elastictk-run\] (worker_failed|worker_frozen|inplace_\w+|workers_started|job_finished|succeeded|failed|restart )|injected|resumed|final checksum")


def run(label: str, args: list[str], stop_rank_after: int | None = None) -> tuple[int, str | None, list[dict[int, int]], list[float]]:
    """One job; (exit code, final checksum, worker PIDs per generation, recovery ms)."""
    print(f"\n=== {label} ===", flush=True)
    cmd = [sys.executable, "-m", "elastictk.run", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ELASTICTK_COLLECTIVE_TIMEOUT": "3"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    checksum, generations, took, stopped = None, [], [], False
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if SHOWN.search(line):
            print("  " + line, flush=True)
        if m := re.search(r"final checksum (\w+)", line):
            checksum = m.group(1)
        if m := re.search(r"(?:workers_started|inplace_recovered) .*pids=(\{[^}]*\})", line):
            generations.append(ast.literal_eval(m.group(1)))  # local rank -> PID (one node: = rank)
        if m := re.search(r"inplace_recovered .*took_ms=([\d.]+)", line):
            took.append(float(m.group(1)))
        step = re.search(r"\[rank 0\] step (\d+)", line)
        if (stop_rank_after is not None and not stopped and len(generations) == 2 and step
                and int(step.group(1)) >= stop_rank_after):
            pid = generations[-1][1]
            print(f"  >>> demo: SIGSTOP rank 1 (pid {pid}) from outside: a hang", flush=True)
            os.kill(pid, signal.SIGSTOP)
            stopped = True
    return proc.wait(), checksum, generations, took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    crash_rank = min(2, a.workers - 1)
    with tempfile.TemporaryDirectory(prefix="elastictk-demo-inplace-") as tmp:
        common = ["--standalone", "--nproc-per-node", str(a.workers), "--max-restarts", "3",
                  "--recovery", "in-place", "--log-dir", str(Path(tmp) / "logs"),
                  str(HERE / "train_inplace.py"), "--steps", str(a.steps), "--step-time", "0.05"]
        code, ref, _, _ = run("reference: no faults", common)
        if code != 0 or ref is None:
            print(f"demo: the reference run failed (exit {code})", file=sys.stderr)
            return 1
        code, got, gens, took = run(
            f"in-place: rank {crash_rank} crashes at step 12, rank 1 hangs later",
            common + ["--crash", f"12:{crash_rank}"], stop_rank_after=20)
    print("\n=== result ===")
    ok = True
    if code != 0:
        print(f"FAIL: the job exited {code}")
        ok = False
    if len(gens) != 3:
        print(f"FAIL: expected the start and two in-place recoveries, saw {len(gens)} generation(s)")
        ok = False
    else:
        for g, (before, after) in enumerate(zip(gens, gens[1:]), 1):
            new = sorted(r for r in after if after[r] != before[r])
            print(f"generation {g}: replaced rank(s) {new}; the other {len(after) - len(new)} kept their PIDs"
                  f" (recovered in {took[g - 1]:.0f} ms, as the agent saw it)" if g <= len(took) else "")
            ok = ok and len(new) == 1
    same = got == ref and got is not None
    print(f"final checksum {got} vs reference {ref}: {'identical' if same else 'DIFFERENT'}")
    ok = ok and same
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

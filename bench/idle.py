"""What watching costs: the launcher's own CPU while its workers sleep.

An idle job (N workers blocked in ``time.sleep``) should cost its launcher next to nothing: a
launcher that polls on short fixed ticks burns a share of a core for every job on the machine
all the time. Both launchers run the same sleeping script with ``--standalone``; once every
worker has started, the CPU time (user + system) of the launcher's processes, workers and their
children excluded, is read twice, a window apart (elastictk: the agent, its preload fork server
and its death watch; torchrun: its agent). A sample is that CPU time as a share of one core.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from .common import BenchError, BenchResult, Comparison, Measured, RunConfig, interleaved

TITLE = "Idle watching cost: launcher CPU while N workers sleep, elastictk-run vs torchrun"
ROOT = Path(__file__).resolve().parent.parent
LAUNCHERS = {
    "elastictk-run": [sys.executable, "-m", "elastictk.run"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}
WORKER = ("import os, sys, time\n"
          "open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close()\n"
          "time.sleep(3600)\n")


def _cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _launcher_processes(root: psutil.Process, workers: set[int]) -> list[psutil.Process]:
    """The launcher and its descendants that are neither workers nor under a worker."""
    out = [root]
    for child in root.children(recursive=True):
        try:
            lineage = {p.pid for p in child.parents()}
        except psutil.NoSuchProcess:
            continue
        if child.pid not in workers and not lineage & workers:
            out.append(child)
    return out


def sample(launcher: str, workers: int, window: float, base: Path) -> float:
    run = Path(tempfile.mkdtemp(dir=base))
    marks = run / "marks"
    marks.mkdir()
    script = run / "sleeper.py"
    script.write_text(WORKER)
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": "", "LOGLEVEL": "WARNING"}
    proc = subprocess.Popen([*LAUNCHERS[launcher], "--standalone", "--nproc-per-node", str(workers),
                             str(script), str(marks)], cwd=run, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(marks.iterdir())) < workers:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"{launcher} did not start {workers} workers (exit {proc.poll()})")
            time.sleep(0.05)
        time.sleep(1.0)  # let start-up work (imports, rendezvous threads) settle
        pids = {int(p.name) for p in marks.iterdir()}
        procs = _launcher_processes(psutil.Process(proc.pid), pids)
        before, t0 = _cpu(procs), time.monotonic()
        time.sleep(window)
        used, elapsed = _cpu(procs) - before, time.monotonic() - t0
        return 100.0 * used / elapsed
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(run, ignore_errors=True)


def run(cfg: RunConfig) -> BenchResult:
    sizes = (2,) if cfg.quick else (2, 8)
    window = 2.0 if cfg.quick else 20.0
    rounds = 1 if cfg.quick else 3
    base = Path(tempfile.mkdtemp(prefix="etk-bench-idle-"))
    rows = []
    try:
        for n in sizes:
            cfg.log(f"idle: {n} workers, {rounds} x {window:g} s windows per launcher")
            got = interleaved(list(LAUNCHERS), lambda name: sample(name, n, window, base), rounds)
            rows.append(Comparison(
                {"workers": str(n)},
                Measured("elastictk-run", got["elastictk-run"]),
                Measured("torchrun", got["torchrun"]),
            ))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return BenchResult(
        name="idle", title=TITLE, description=__doc__ or "", unit="% of one core",
        higher_is_better=False, rows=rows,
        params={"window_s": window, "rounds": rounds},
        notes=["Workers sleep; only the launchers' own processes are counted."],
    )

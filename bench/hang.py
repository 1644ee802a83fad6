"""Hang detection time with default flags: elastictk-run's learned deadlines against torchrun's
backend timeout and NVIDIA's resiliency extension (NVRx) defaults.

A 2-rank DDP job on gloo (CPU) with 0.05 s steps (``tests/helpers/pace_job.py``) runs under
``elastictk-run`` with no hang-related flag. After warm-up (step 60, 20 steps after a 1 s eval) one rank hangs in one of
three ways: it is frozen (SIGSTOP), it never joins the ``all_reduce`` its peer makes, or it never
joins its peer's DDP ``backward()`` (the all-reduce DDP issues from C++). A sample is the
seconds from the fault (the rank's own monotonic stamp) to the agent's ``hang_detected`` event
naming it; the recovery (the next attempt's first step) is recorded beside it.

The references are not run: with default flags torchrun waits for the process group's
timeout (gloo and NCCL: 30 minutes, ``torch.distributed`` documentation) and NVRx's
``ft_launcher`` for its ``rank_heartbeat_timeout`` (45 minutes by default; its timeouts can be
calculated from observed heartbeats, times a safety factor of 5, once the script asks for it).
Their rows give those documented values as their one sample, marked as such.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import BenchError, BenchResult, Comparison, Measured, RunConfig

TITLE = "Hang detection time with default flags: elastictk-run (learned) vs torchrun and NVRx defaults"
ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "helpers" / "pace_job.py"
MODES = ("freeze", "skip", "skip-ddp")
TORCH_S = 1800.0  # torch.distributed: default process group timeout (gloo and NCCL), 30 min
NVRX_S = 2700.0  # nvidia-resiliency-ext FaultToleranceConfig.rank_heartbeat_timeout default


def sample(mode: str, base: Path) -> tuple[float, float, float]:
    """(fault to named, fault to the next attempt's first step, the learned deadline) in s."""
    from elastictk.metrics.events import read_events

    run = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=base))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICTK_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "1", "--log-dir", str(run / "logs"), "--event-log",
            str(run / "events.jsonl"), str(JOB), str(run), "80", "1", mode, "60"]
    proc = subprocess.Popen(argv, env=env, cwd=run, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        code = proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise BenchError(f"hang {mode}: elastictk-run did not finish within 300 s ({run})") from None
    finally:
        fault = run / "fault"
        if fault.exists():
            try:
                os.kill(int(fault.read_text().split()[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        if code != 0:
            raise BenchError(f"hang {mode}: elastictk-run exited {code} ({run})")
        at = float((run / "fault").read_text().split()[1])
        hangs = read_events(run / "events.jsonl", {"hang_detected"})
        if len(hangs) != 1:
            raise BenchError(f"hang {mode}: {len(hangs)} hang_detected events, expected 1 ({run})")
        first = float((run / "a1.r0.first").read_text())
        deadline = float(hangs[0].fields.get("timeout_s") or 0.0)
        return hangs[0].mono - at, first - at, deadline
    finally:
        shutil.rmtree(run, ignore_errors=True)


def run(cfg: RunConfig) -> BenchResult:
    modes = MODES[:1] if cfg.quick else MODES
    rounds = 1 if cfg.quick else 3
    base = Path(tempfile.mkdtemp(prefix="etk-bench-hang-"))
    rows, notes = [], []
    try:
        for mode in modes:
            cfg.log(f"hang: {mode}, {rounds} run(s) of elastictk-run with default flags")
            got = [sample(mode, base) for _ in range(rounds)]
            named = [g[0] for g in got]
            rows.append(Comparison({"hang": mode, "reference": "torchrun (backend timeout)"},
                                   Measured("elastictk-run, default flags", named,
                                            {"recovered_s": [round(g[1], 2) for g in got],
                                             "learned_deadline_s": [g[2] for g in got]}),
                                   Measured("torchrun, default flags (documented, not run)", [TORCH_S]),
                                   note="documented 30 min process group timeout"))
            rows.append(Comparison({"hang": mode, "reference": "NVRx ft_launcher"},
                                   Measured("elastictk-run, default flags", named),
                                   Measured("NVRx rank_heartbeat_timeout (documented, not run)", [NVRX_S]),
                                   note="documented 45 min default; calculated timeouts: 5 x observed"))
            notes.append(f"{mode}: next attempt's first step {', '.join(f'{g[1]:.1f}' for g in got)} s "
                         f"after the fault; learned deadline {', '.join(f'{g[2]:g}' for g in got)} s")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return BenchResult(
        name="hang", title=TITLE, description=__doc__ or "", unit="s from the hang to the culprit named",
        higher_is_better=False, rows=rows, params={"rounds": rounds, "modes": list(modes), "step_s": 0.05},
        notes=[*notes, "References are documented defaults, one value each, not measured here."],
    )

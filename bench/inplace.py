"""In-place recovery: 1 of N workers is SIGKILLed; how long until every rank steps again.

Four ways to recover, on one job (``examples/train.py``'s model, data and optimizer):

- **in-place**: ``elastictk-run --recovery in-place`` running ``examples/train_inplace.py``
  (``elastictk.run_elastic``): the survivors keep their processes, roll back to their in-memory
  commit and re-form the gloo group; only the killed rank is replaced, by the preload server's
  hot standby (a process forked and warmed ahead of need), and receives the state from a peer
  over the new group. No checkpoint is read.
- **in-place, --standby 0**: the same, the replacement forked from the preload server at the
  failure (the path before the standby).
- **restart-all**: ``elastictk-run`` as it ships, running ``examples/train.py``: every worker
  is stopped and forked again, and resumes from the last checkpoint on disk.
- **torchrun** (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, see ``bench/recovery.py``), the same
  script: every worker is stopped and started as a fresh interpreter that imports torch.

Each launch is ``bench/recovery.py``'s: the last rank's worker is SIGKILLed once every rank is
past the first checkpoint, and the sample runs from the kill until every rank has logged a step
after its ``resumed at step S (attempt A)`` line (in-place: A is the new generation). A launch
counts only if the job then finishes with exit 0, the launcher named the killed rank's SIGKILL,
and the final checksum equals every other launch's, of all four subjects: weights after an
in-place recovery are those of a restart from a checkpoint, and of a run without faults.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from . import recovery as rec
from .common import BenchError, BenchResult, Comparison, Measured, RunConfig, interleaved

TITLE = "In-place recovery (hot standby, fork) vs restart-all vs torchrun: 1 of N workers SIGKILLed"
INPLACE_SCRIPT = rec.ROOT / "examples" / "train_inplace.py"
TARGET_SHARE = 1 / 50

IN_PLACE = rec.Launcher("in-place", "elastictk-run --recovery in-place --standby 1", "elastictk-run",
                        "elastictk.run", flags=("--recovery", "in-place", "--standby", "1"),
                        script=INPLACE_SCRIPT)
NO_STANDBY = rec.Launcher("in-place-no-standby", "... in-place --standby 0", "elastictk-run",
                          "elastictk.run", flags=("--recovery", "in-place", "--standby", "0"),
                          script=INPLACE_SCRIPT)
RESTART_ALL = rec.Launcher("restart-all", "elastictk-run (restart-all)", "elastictk-run",
                           "elastictk.run")
TORCHRUN = rec.TORCHRUN
SUBJECTS = (IN_PLACE, NO_STANDBY, RESTART_ALL, TORCHRUN)
TARGET_RESUMED = 0.025  # seconds from the kill until every rank resumed, with the hot standby


def run(cfg: RunConfig) -> BenchResult:
    n = 2 if cfg.quick else 4
    rounds = 1 if cfg.quick else 5
    got: dict[str, list[rec.Sample]] = {s.key: [] for s in SUBJECTS}
    by_key = {s.key: s for s in SUBJECTS}
    pids: list[int] = []
    checksums: set[str] = set()
    base = Path(tempfile.mkdtemp(prefix="etk-bench-inplace-"))
    counter = iter(range(10_000))
    try:
        def one(key: str) -> float:
            launcher = by_key[key]
            s = rec._launch(launcher, n, base, f"{key}-{next(counter)}",
                            recovery_timeout=rec.RECOVERY_TIMEOUT)
            pids.extend(s.pids)
            got[key].append(s)
            checksums.add(s.checksum or "?")
            cfg.log(f"  {launcher.label:34} N={n}: recovery {s.recovery:6.3f}s "
                    f"(attempt/generation {s.attempt})")
            return s.recovery or 0.0

        cfg.log(f"{n} workers, {rounds} launch(es) of each ...")
        interleaved([s.key for s in SUBJECTS], one, rounds)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if len(checksums) != 1:
        raise BenchError(f"launches ended with different final checksums {sorted(checksums)}; "
                         "a recovery resumed wrongly")

    def measured(key: str, phase: str | None = None) -> Measured:
        ss = got[key]
        extra: dict[str, Any] = {"attempt": [s.attempt for s in ss],
                                 "phases_s_after_kill": [s.phases for s in ss]}
        values = [float(s.recovery or 0.0) if phase is None else float(s.phases.get(phase, 0.0))
                  for s in ss]
        return Measured(by_key[key].label, values, extra)

    case = {"measure": "kill to every rank stepping again", "workers": str(n)}
    resumed = {"measure": "kill to every rank resumed (group formed, state loaded)", "workers": str(n)}
    rows = [
        Comparison(resumed, measured(IN_PLACE.key, "all_resumed"),
                   measured(NO_STANDBY.key, "all_resumed")),
        Comparison(resumed, measured(NO_STANDBY.key, "all_resumed"),
                   measured(TORCHRUN.key, "all_resumed"), rec.REF_NOTE),
        Comparison(case, measured(IN_PLACE.key), measured(TORCHRUN.key), rec.REF_NOTE),
        Comparison(case, measured(RESTART_ALL.key), measured(TORCHRUN.key), rec.REF_NOTE),
        Comparison(case, measured(IN_PLACE.key), measured(RESTART_ALL.key)),
        Comparison(resumed, measured(IN_PLACE.key, "all_resumed"),
                   measured(TORCHRUN.key, "all_resumed"), rec.REF_NOTE),
    ]
    notes = []
    for what, phase in (("stepping again", None), ("resumed", "all_resumed")):
        ours = statistics.median(measured(IN_PLACE.key, phase).samples)
        ref = statistics.median(measured(TORCHRUN.key, phase).samples)
        share = ours / ref if ref else float("inf")
        notes.append(
            f"target (in-place recovery in <= 1/{round(1 / TARGET_SHARE)} of torchrun's time), "
            f"{n} workers, kill to every rank {what}: in-place takes {share:.4f} of torchrun's "
            f"time (1/{1 / share:.0f}), so it {'meets' if share <= TARGET_SHARE else 'misses'} it")
    best = statistics.median(measured(IN_PLACE.key, "all_resumed").samples)
    fork = statistics.median(measured(NO_STANDBY.key, "all_resumed").samples)
    notes.append(
        f"target (every rank resumed <= {TARGET_RESUMED * 1000:.0f} ms after the kill, with the hot "
        f"standby), {n} workers: {best * 1000:.1f} ms (without the standby {fork * 1000:.1f} ms), so "
        f"it {'meets' if best <= TARGET_RESUMED else 'misses'} it")
    notes.append(
        f"'stepping again' includes one whole step of the job after the recovery ({rec.STEP_TIME}s "
        "of sleep, then the step's line): the same for every subject, and most of in-place's time")
    for s in SUBJECTS:
        notes.append(rec._phase_note(s.label, n, got[s.key]))
    notes.append(
        f"job: {rec.STEPS} steps, the worker of the last rank SIGKILLed once every rank is past "
        f"step {rec.CKPT_EVERY}; every launch exited 0 with final checksum {next(iter(checksums))}")
    notes.append(f"{os.cpu_count()} cores; {n} workers share them")
    return BenchResult(
        name="inplace", title=TITLE, description=(__doc__ or "").split("\n", 1)[1].strip(),
        unit="s", higher_is_better=False, rows=rows, notes=notes,
        params={"workers": n, "rounds": rounds, "steps": rec.STEPS, "step_time": rec.STEP_TIME,
                "ckpt_every": rec.CKPT_EVERY, "max_restarts": rec.MAX_RESTARTS,
                "killed_rank": "last", "quick": cfg.quick},
        pids=sorted(set(pids)),
    )

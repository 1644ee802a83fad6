"""Recovery: a worker of a running job is SIGKILLed; how long until every rank trains again.

This is the number an operator of a flaky cluster pays on every fault: from the moment one
worker dies until all ranks of the restarted job are taking steps again, nobody trains. Both
launchers run the same deterministic job (``examples/train.py``: gloo data parallel, a checkpoint
every few steps, resume from it on restart) with the same flags::

    <launcher> --standalone --nproc-per-node N --max-restarts 3 --log-dir <tmp> \\
        examples/train.py --steps S --ckpt-every C --step-time T --ckpt-dir <tmp>

One launch gives two samples, measured from outside the launcher on its merged stdout/stderr,
each line stamped with ``time.monotonic()`` as a reader thread receives it:

- **cold start**: from starting the launcher until every rank has logged its first step;
- **recovery**: once every rank has logged a step past the first checkpoint, the worker of the
  last rank is SIGKILLed (found as a descendant of the launcher, see ``bench/_recovery_job.py``);
  the sample is the time from the kill until every rank has logged its first step *after* the
  ``resumed at step ... (attempt A)`` line of the restarted attempt (A >= 1, so a late line of
  the killed attempt can never count).

Then the job runs to the end, and the launch counts only if the launcher exits 0, the killed rank
is the failure the launcher reported, and the job printed the same final checksum as every other
launch with the same N, of either launcher: a launcher cannot look fast by resuming wrongly.

Subjects (interleaved launches, order reversed every other round): ``elastictk-run`` as it
ships (Python workers fork from a server that imported torch once), and ``torchrun`` with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, torch's documented workaround for restarts: with its
default (workers share the agent's rendezvous store) torchrun's restarted workers can read keys
the killed attempt left in that store, and then the restart fails or hangs
(pytorch/pytorch#135712); on this machine that happens in most launches, not in all. One launch
of torchrun with its defaults (2 workers) is reported in the notes, with how it ended.
"""
from __future__ import annotations

import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ._recovery_job import Job
from .common import BenchError, BenchResult, Comparison, Measured, RunConfig, fmt, interleaved

TITLE = "Recovery after a SIGKILLed worker, and cold start: elastictk-run vs torchrun"
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train.py"

STEPS = 20
CKPT_EVERY = 3
STEP_TIME = 0.05
MAX_RESTARTS = 3
COLD_TIMEOUT = 180.0
RECOVERY_TIMEOUT = 120.0
PROBE_TIMEOUT = 30.0  # for torchrun with its defaults, which may never recover
EXIT_TIMEOUT = 120.0

SHARED_STORE_FIX = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
REF_NOTE = (
    "torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (rank 0's worker hosts the job's "
    "store, as under elastictk-run); with torch's default its restarts are unreliable "
    "(pytorch/pytorch#135712), see the notes"
)


@dataclass(frozen=True)
class Launcher:
    key: str
    label: str
    program: str  # console script next to this interpreter
    module: str  # the same, as ``python -m``, if the script is missing
    env: dict[str, str] = field(default_factory=dict)
    flags: tuple[str, ...] = ()  # launcher flags of this subject (e.g. --recovery in-place)
    script: Path = SCRIPT  # the training script (it must print what ``_recovery_job`` reads)

    def argv(self) -> list[str]:
        script = Path(sys.executable).parent / self.program
        if script.exists():
            return [str(script)]
        return [sys.executable, "-m", self.module]


ELASTICTK = Launcher("elastictk", "elastictk-run", "elastictk-run", "elastictk.run")
TORCHRUN = Launcher("torchrun", "torchrun", "torchrun", "torch.distributed.run", SHARED_STORE_FIX)
TORCHRUN_DEFAULT = Launcher("torchrun-default", "torchrun (defaults)", "torchrun",
                            "torch.distributed.run")


@dataclass
class Sample:
    """One launch: its two timings, where the recovery time went, and what the job ended with."""

    cold: float
    recovery: Optional[float]  # None: did not recover in time (only allowed for the probe)
    phases: dict[str, float]  # seconds after the kill
    attempt: int  # TORCHELASTIC_RESTART_COUNT of the attempt that recovered
    checksum: Optional[str]
    pids: list[int]
    exit_code: Optional[int] = None  # set when the launcher had ended by the time it was stopped


def _launch(launcher: Launcher, n: int, base: Path, tag: str, *, recovery_timeout: float,
            must_recover: bool = True) -> Sample:
    """Run the job once under ``launcher``, kill the last rank mid-run, time it, verify it."""
    work = base / tag
    work.mkdir()
    argv = launcher.argv() + [
        "--standalone", "--nproc-per-node", str(n), "--max-restarts", str(MAX_RESTARTS),
        "--log-dir", str(work / "logs"), *launcher.flags, str(launcher.script),
        "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--step-time", str(STEP_TIME),
        "--ckpt-dir", str(work / "ckpt"),
    ]
    env = {"TMPDIR": str(work), **launcher.env}
    job = Job(argv, cwd=ROOT, log=work / "output.log", env=env)
    victim = n - 1
    try:
        t0 = job.start()
        job.wait_for(lambda tl: len(tl.first_step) == n, COLD_TIMEOUT, "first step on every rank")
        cold = max(job.timeline.first_step.values()) - t0
        proc = job.worker(victim, n)
        # Past the first checkpoint, so the restarted attempt resumes (and says so).
        job.wait_for(lambda tl: len(tl.last_step) == n and min(tl.last_step.values()) > CKPT_EVERY,
                     COLD_TIMEOUT, f"step {CKPT_EVERY + 1} on every rank")
        t_kill = time.monotonic()
        try:
            proc.kill()  # psutil refuses if the pid no longer names that process
        except Exception as e:  # noqa: BLE001 - psutil.NoSuchProcess and kin
            raise BenchError(f"{job.name}: rank {victim} was gone before the kill ({e}); "
                             f"{job.tail()}") from None
        recovery: Optional[float] = None
        try:
            job.wait_for(lambda tl: tl.recovered(n), recovery_timeout,
                         "step after the restart on every rank")
            recovery = max(t for t, _ in job.timeline.step_after_resume.values()) - t_kill
        except BenchError:
            if must_recover:
                raise
        if recovery is None:
            ended = job.returncode()
            return Sample(cold, None, _phases(job, t_kill), max(job.timeline.attempts, default=0),
                          None, job.close(), ended)
        code = job.wait_exit(EXIT_TIMEOUT)
        tl = job.timeline
        if code != 0:
            raise BenchError(f"{job.name}: exited {code} after recovering; {job.tail()}")
        if tl.final is None or tl.final[2] != STEPS:
            raise BenchError(f"{job.name}: no 'final checksum ... after {STEPS} steps' line; "
                             f"{job.tail()}")
        _check_failure_reported(job, launcher, victim)
        attempt = tl.resumed[0][2]
        return Sample(cold, recovery, _phases(job, t_kill), attempt, tl.final[1], job.close())
    finally:
        job.close()


def _check_failure_reported(job: Job, launcher: Launcher, victim: int) -> None:
    """The launcher must name the killed rank as the failure, by SIGKILL."""
    tl = job.timeline
    if launcher.module == ELASTICTK.module:
        ev = tl.agent_event("worker_failed")
        ok = ev is not None and re.search(rf"(^| )rank={victim}( |$)", ev[1]) is not None \
            and "exit=SIGKILL" in ev[1]
    else:
        ev = tl.agent_event("torch_worker_failed")
        ok = ev is not None and f"exitcode: -9) local_rank: {victim} " in ev[1]
    if not ok:
        raise BenchError(f"{job.name}: the reported failure is not rank {victim}'s SIGKILL "
                         f"({ev[1] if ev else 'none reported'}); {job.tail()}")


def _phases(job: Job, t_kill: float) -> dict[str, float]:
    """Milestones of the recovery, in seconds after the kill, as far as the output shows them."""
    tl = job.timeline
    out: dict[str, float] = {}
    for event in ("worker_failed", "restart", "round_joined", "workers_started",
                  "torch_worker_failed", "torch_stopping_workers"):
        ev = tl.agent_event(event, after=t_kill)
        if ev is not None:
            out[event] = ev[0] - t_kill
    if tl.resumed:
        out["first_resumed"] = min(t for t, _, _ in tl.resumed.values()) - t_kill
        out["all_resumed"] = max(t for t, _, _ in tl.resumed.values()) - t_kill
    if tl.step_after_resume:
        out["all_stepped"] = max(t for t, _ in tl.step_after_resume.values()) - t_kill
    return out


# -- the run -----------------------------------------------------------------------------------
PHASE_ORDER = ("worker_failed", "torch_stopping_workers", "torch_worker_failed", "restart", "round_joined",
               "workers_started", "first_resumed", "all_resumed", "all_stepped")
PHASE_TEXT = {
    "worker_failed": "agent saw the exit (worker_failed)",
    "torch_stopping_workers": "agent began stopping the other workers",
    "torch_worker_failed": "agent logged the failure",
    "restart": "restart decided",
    "round_joined": "rendezvous round joined",
    "workers_started": "workers started",
    "first_resumed": "first rank resumed (init_process_group done, checkpoint loaded)",
    "all_resumed": "last rank resumed",
    "all_stepped": "last rank's first step",
}


def _phase_note(label: str, n: int, samples: list[Sample]) -> str:
    keys = [k for k in PHASE_ORDER if all(k in s.phases for s in samples)]
    parts = [f"{PHASE_TEXT[k]} {fmt(statistics.median(s.phases[k] for s in samples))}"
             for k in keys]
    return (f"{label}, {n} workers, median seconds after the kill: " + "; ".join(parts)
            if parts else f"{label}, {n} workers: no milestones in its output")


def _probe_note(n: int, s: Sample) -> str:
    head = f"torchrun with its defaults (shared rendezvous store), {n} workers, one launch"
    if s.recovery is None and s.exit_code is not None:
        return f"{head}: gave up with exit code {s.exit_code} instead of recovering"
    if s.recovery is None:
        return (f"{head}: the restarted job took no step on every rank within "
                f"{PROBE_TIMEOUT:.0f}s of the kill (last restart attempt that loaded the "
                f"checkpoint: {s.attempt or 'none'}); stopped it")
    return f"{head}: recovered in {fmt(s.recovery)}s, in restart attempt {s.attempt}"


def run(cfg: RunConfig) -> BenchResult:
    workers = (2,) if cfg.quick else (2, 4)
    rounds = 1 if cfg.quick else 5
    subjects = {ELASTICTK.key: ELASTICTK, TORCHRUN.key: TORCHRUN}
    rows: list[Comparison] = []
    notes: list[str] = []
    pids: list[int] = []
    checksums: dict[int, set[str]] = {}
    base = Path(tempfile.mkdtemp(prefix="etk-bench-recovery-"))
    try:
        for n in workers:
            got: dict[str, list[Sample]] = {k: [] for k in subjects}
            counter = iter(range(10_000))

            def one(key: str) -> float:
                launcher = subjects[key]
                s = _launch(launcher, n, base, f"{key}-n{n}-{next(counter)}",
                            recovery_timeout=RECOVERY_TIMEOUT)
                pids.extend(s.pids)
                got[key].append(s)
                checksums.setdefault(n, set()).add(s.checksum or "?")
                cfg.log(f"  {launcher.label:13} N={n}: cold start {s.cold:5.2f}s, "
                        f"recovery {s.recovery:5.2f}s (attempt {s.attempt})")
                return s.recovery or 0.0

            cfg.log(f"{n} workers, {rounds} launch(es) each ...")
            interleaved(list(subjects), one, rounds)
            if len(checksums[n]) != 1:
                raise BenchError(f"{n} workers: launches ended with different final checksums "
                                 f"{sorted(checksums[n])}; a restart resumed wrongly")
            for measure, pick in (("recovery after SIGKILL", "recovery"), ("cold start", "cold")):
                def measured(key: str) -> Measured:
                    ss = got[key]
                    extra: dict[str, Any] = {
                        "attempt": [s.attempt for s in ss],
                        "checksum": sorted({s.checksum or "?" for s in ss}),
                    }
                    if pick == "recovery":
                        extra["phases_s_after_kill"] = [s.phases for s in ss]
                    return Measured(subjects[key].label,
                                    [float(getattr(s, pick)) for s in ss], extra)

                rows.append(Comparison({"measure": measure, "workers": str(n)},
                                       measured(ELASTICTK.key), measured(TORCHRUN.key), REF_NOTE))
            for key in subjects:
                notes.append(_phase_note(subjects[key].label, n, got[key]))
            torch_attempts = sorted({s.attempt for s in got[TORCHRUN.key]})
            if torch_attempts != [1]:
                notes.append(f"torchrun, {n} workers: recovered in restart attempts "
                             f"{torch_attempts} (a failed restart attempt is part of its time)")
        if not cfg.quick:
            for n in workers[:1]:  # the failure does not depend on N; one launch shows it
                cfg.log(f"torchrun with its defaults, {n} workers (one launch) ...")
                s = _launch(TORCHRUN_DEFAULT, n, base, f"probe-n{n}",
                            recovery_timeout=PROBE_TIMEOUT, must_recover=False)
                pids.extend(s.pids)
                if s.checksum is not None and s.checksum not in checksums[n]:
                    raise BenchError(f"torchrun with its defaults, {n} workers: final checksum "
                                     f"{s.checksum}, others {sorted(checksums[n])}")
                notes.append(_probe_note(n, s))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    notes += _target_notes(rows)
    notes.append(
        f"job: examples/train.py, {STEPS} steps, checkpoint every {CKPT_EVERY}, {STEP_TIME}s "
        f"sleep per step; the worker of the last rank is SIGKILLed once every rank is past step "
        f"{CKPT_EVERY}; every launch exited 0 with final checksum "
        + ", ".join(f"{next(iter(checksums[n]))} (N={n})" for n in workers)
    )
    notes.append(f"{os.cpu_count()} cores: with 4 workers the ranks share cores, and importing "
                 "torch in each fresh worker competes for them")
    return BenchResult(
        name="recovery",
        title=TITLE,
        description=(__doc__ or "").split("\n", 1)[1].strip(),
        unit="s",
        higher_is_better=False,
        rows=rows,
        notes=notes,
        params={"workers": list(workers), "rounds": rounds, "steps": STEPS,
                "ckpt_every": CKPT_EVERY, "step_time": STEP_TIME, "max_restarts": MAX_RESTARTS,
                "killed_rank": "last", "quick": cfg.quick},
        pids=sorted(set(pids)),
    )


def _target_notes(rows: list[Comparison]) -> list[str]:
    """elastictk's stated goal: recover in at most a quarter of torchrun's time."""
    out = []
    for row in rows:
        if row.case["measure"] != "recovery after SIGKILL":
            continue
        ours, ref = row.ours.stats.median, row.ref.stats.median
        share = ours / ref if ref else float("inf")
        verdict = "meets" if share <= 0.25 else "misses"
        out.append(f"target (recovery in <= 1/4 of torchrun's time), {row.case['workers']} "
                   f"workers: elastictk-run takes {share:.2f} of torchrun's time, so it {verdict} it")
    return out

"""Failure propagation across nodes: one worker of a 3-node job dies; how fast does every node react?

When one worker of a multi-node job dies, its peers on the other nodes cannot train without it.
Until they are stopped they hold their accelerators waiting in a collective, and the job cannot
re-form until every node has let go of the dead attempt. Here three launcher processes on this
machine play three nodes of one job (``--nnodes 3 --nproc-per-node 2``, six ranks), sharing one
c10d rendezvous endpoint on loopback, with the same flags for both launchers::

    <launcher> --nnodes 3 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID --max-restarts 3 \\
        --rdzv-conf last_call_timeout=1,heartbeat_interval=0.2,heartbeat_timeout=2 \\
        examples/train.py --steps S --ckpt-every 3 --step-time T --ckpt-dir <tmp>

``examples/train.py`` all-reduces gradients with gloo every step and then sleeps ``T`` seconds
(the step's "compute"), so every rank meets every other rank once per step. Once every rank is
past the first checkpoint, after a random fraction of a step (so the fault lands anywhere in a
step), the last rank's worker is SIGKILLed through a pidfd, and three times are taken from
that moment:

- **every worker stopped**: until all six workers of the killed attempt have terminated, on
  every node (each watched through its own pidfd, which the kernel marks readable the moment its
  process ends), whoever stopped them;
- **every agent reacted**: until each of the three agents has logged that it stops its workers,
  and why (see ``bench/_propagation_report.py``): the launcher's own propagation;
- **every rank stepping again**: until every rank has logged its first step in the attempt that
  ran to the end (the first step line after the rank's last ``resumed at step`` line), read from
  the launchers' output as it arrives.

Two step times: with short steps the survivors soon enter an ``all_reduce`` with the dead rank,
whose sockets the kernel closed, gloo raises and they exit by themselves, whatever the launcher
does; with long steps they sleep through most of a step first, so what stops them sooner is the
launcher's own doing. Then the job runs to the end, and a launch counts only if all three
launchers exit 0 and the job prints the same final checksum as every other launch of the same
length, of either launcher: a launcher cannot look fast by resuming wrongly.

Subjects (interleaved launches, order reversed every other round): ``elastictk-run`` as it
ships, and ``torchrun`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (rank 0's worker hosts the
job's store, as under elastictk-run) and ``LOGLEVEL=INFO`` (so its agents log when and why they
stop their workers). With torch's default store sharing, a trial launch of this job never
recovered: every restarted attempt failed in gloo's ``connectFullMesh`` (connection refused to
an address the killed attempt left in the shared store, pytorch/pytorch#135712) until
``--max-restarts`` was spent.

In the full run, the first launch of each launcher freezes the victim with SIGSTOP before it
kills it: a frozen worker stays alive with its sockets open, so nothing fails, and every peer
waits in ``all_reduce`` until gloo's timeout (30 min by default). The notes say how many workers
either launcher had stopped when the freeze was lifted (SIGCONT) after a fixed cap; the job then
trains on and the SIGKILL follows as in every other launch.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from ._propagation_job import Cluster, ExitWatch, Timeline
from ._propagation_report import Kind, Sample, analyse, freeze_note, sample_notes
from .common import BenchError, BenchResult, Comparison, Measured, RunConfig, interleaved

TITLE = "Failure propagation across 3 nodes (SIGKILLed worker): elastictk-run vs torchrun"
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train.py"

NODES = 3
NPROC = 2
WORLD = NODES * NPROC
VICTIM = WORLD - 1  # the last rank: local rank 1 of the node with group rank 2
MAX_RESTARTS = 3
RDZV_CONF = "last_call_timeout=1,heartbeat_interval=0.2,heartbeat_timeout=2"
CKPT_EVERY = 3
START_TIMEOUT = 240.0
STOP_TIMEOUT = 120.0  # gloo errors reach SIGKILLed workers' peers; nothing should take this long
RECOVERY_TIMEOUT = 240.0
EXIT_TIMEOUT = 240.0
FREEZE_CAP = 10.0
TARGET_S = 0.1  # elastictk's goal for its agents to act on a failure anywhere in the job


@dataclass(frozen=True)
class Case:
    """A job length and step time, and how many launches of each launcher it gets."""

    step_time: float
    steps: int  # at least CKPT_EVERY + 3, so the victim still runs when the kill lands
    rounds: int


# Short steps: the survivors soon enter an all_reduce with the dead rank, whose sockets the
# kernel closed, and gloo raises. Long steps: they sleep through most of a step first, so
# whatever stops them before that is the launcher's own doing.
FULL = (Case(0.25, 8, 3), Case(1.5, 6, 2))
QUICK = (Case(0.1, 7, 1),)


@dataclass(frozen=True)
class Launcher:
    key: str
    label: str
    program: str  # console script next to this interpreter
    module: str  # the same, as ``python -m``, if the script is missing
    kind: Kind
    env: dict[str, str] = field(default_factory=dict)

    def argv(self) -> list[str]:
        script = Path(sys.executable).parent / self.program
        return [str(script)] if script.exists() else [sys.executable, "-m", self.module]


ELASTICTK = Launcher("elastictk", "elastictk-run", "elastictk-run", "elastictk.run", "elastictk")
TORCHRUN = Launcher("torchrun", "torchrun", "torchrun", "torch.distributed.run", "torch",
                    {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO"})
REF_NOTE = (
    "torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (rank 0's worker hosts the job's "
    "store, as under elastictk-run) and LOGLEVEL=INFO (so its agents log their transitions)"
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cluster(launcher: Launcher, p: Case, work: Path, tag: str) -> Cluster:
    port = _free_port()
    argv = launcher.argv() + [
        "--nnodes", str(NODES), "--nproc-per-node", str(NPROC), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", tag,
        "--max-restarts", str(MAX_RESTARTS), "--rdzv-conf", RDZV_CONF, str(SCRIPT),
        "--steps", str(p.steps), "--ckpt-every", str(CKPT_EVERY),
        "--step-time", str(p.step_time), "--ckpt-dir", str(work / "ckpt"),
    ]
    # TMPDIR: whatever a launcher writes to temp (torchrun's log dirs) goes where we delete it.
    env = {"TMPDIR": str(work), **launcher.env}
    return Cluster([argv] * NODES, cwd=ROOT, logs=work / "logs", env=env)


def _watch_workers(job: Cluster, launcher: Launcher, since: float) -> tuple[ExitWatch, dict[int, int]]:
    """Once every rank has logged a step past the first checkpoint at or after ``since``, watch
    every worker's exit; rank -> node as well."""
    def ready(tl: Timeline) -> bool:
        return {r for t, r, step in tl.steps if t >= since and step > CKPT_EVERY} == set(range(WORLD))

    job.wait_for(ready, START_TIMEOUT, f"a step past {CKPT_EVERY} on every rank")
    if launcher.kind == "elastictk":
        found = job.etk_workers(NPROC)
    else:
        found = job.torch_workers(SCRIPT.name)
    per_node = sorted(n for n, _ in found.values())
    if sorted(found) != list(range(WORLD)) or per_node != sorted(list(range(NODES)) * NPROC):
        shown = {r: (n, p.pid) for r, (n, p) in found.items()}
        raise BenchError(f"{launcher.label}: expected ranks 0..{WORLD - 1}, {NPROC} per node; "
                         f"found {{rank: (node, pid)}} = {shown}; {job.tail()}")
    return ExitWatch({r: proc for r, (_, proc) in found.items()}), {r: n for r, (n, _) in found.items()}


def _finish(job: Cluster, launcher: Launcher, p: Case) -> str:
    """The job's checksum, once every launcher exited 0 and the job printed exactly one."""
    codes = job.wait_exit(EXIT_TIMEOUT)
    if codes != [0] * NODES:
        raise BenchError(f"{launcher.label}: launchers exited {codes}; {job.tail()}")
    finals = {(c, s) for _, c, s in job.timeline.finals}
    if len(finals) != 1 or next(iter(finals))[1] != p.steps:
        raise BenchError(f"{launcher.label}: expected one 'final checksum ... after {p.steps} "
                         f"steps' line, got {sorted(finals)}; {job.tail()}")
    return next(iter(finals))[0]


def _kill_launch(launcher: Launcher, p: Case, work: Path, rng: random.Random, pids: list[int],
                 freeze: bool = False) -> Sample:
    """One launch: SIGKILL the victim mid-run, time the stop and the restart, verify the end.

    With ``freeze`` the victim is first SIGSTOPped for FREEZE_CAP seconds and let go with
    SIGCONT; the sample then also says how many workers were stopped during the freeze.
    """
    job = _cluster(launcher, p, work, work.name)
    watch: Optional[ExitWatch] = None
    try:
        job.start()
        watch, node_of = _watch_workers(job, launcher, since=0.0)
        frozen: Optional[int] = None
        if freeze:
            watch.send(VICTIM, signal.SIGSTOP)
            watch.wait_all(FREEZE_CAP)
            frozen = len(watch.exited)
            gone = VICTIM in watch.exited
            t_cont = time.monotonic() if gone else watch.send(VICTIM, signal.SIGCONT)
            watch.close()
            watch = None
            watch, node_of = _watch_workers(job, launcher, since=t_cont)
        time.sleep(rng.uniform(0, p.step_time))  # land anywhere in a step, not right after a print
        t_kill = watch.send(VICTIM, signal.SIGKILL)
        if not watch.wait_all(STOP_TIMEOUT):
            left = sorted(set(range(WORLD)) - set(watch.exited))
            raise BenchError(f"{launcher.label}: ranks {left} still ran {STOP_TIMEOUT:.0f}s after "
                             f"the kill; {job.tail()}")
        job.wait_for(lambda tl: tl.first_step_of_last_attempt(WORLD, t_kill) is not None,
                     RECOVERY_TIMEOUT, "step after the restart on every rank")
        checksum = _finish(job, launcher, p)
        s = analyse(launcher.kind, job.timeline, t_kill, dict(watch.exited), node_of,
                    NODES, VICTIM, checksum)
        s.frozen_stopped = frozen
        return s
    finally:
        if watch is not None:
            watch.close()
        pids.extend(job.close())


def run(cfg: RunConfig) -> BenchResult:
    cases = QUICK if cfg.quick else FULL
    subjects = {ELASTICTK.key: ELASTICTK, TORCHRUN.key: TORCHRUN}
    got: dict[tuple[Case, str], list[Sample]] = {(c, k): [] for c in cases for k in subjects}
    frozen: dict[str, int] = {}
    checksums: dict[int, set[str]] = {}  # steps -> every final checksum seen
    pids: list[int] = []
    rng = random.Random(20261121)
    counter = iter(range(10_000))
    base = Path(tempfile.mkdtemp(prefix="etk-bench-propagation-"))

    def workdir(key: str) -> Path:
        work = base / f"{key}-{next(counter)}"
        work.mkdir()
        return work

    try:
        for case in cases:
            def one(key: str, case: Case = case) -> float:
                launcher = subjects[key]
                # The freeze rides on the first launch of each launcher (a launch of its own
                # would cost a cold start for nothing): SIGSTOP, SIGCONT, then the SIGKILL.
                freeze = not cfg.quick and case is cases[0] and not got[(case, key)]
                if freeze:
                    cfg.log(f"  {launcher.label}: SIGSTOP of rank {VICTIM} for "
                            f"{FREEZE_CAP:.0f}s first ...")
                s = _kill_launch(launcher, case, workdir(key), rng, pids, freeze)
                if s.frozen_stopped is not None:
                    frozen[key] = s.frozen_stopped
                got[(case, key)].append(s)
                checksums.setdefault(case.steps, set()).add(s.checksum)
                cfg.log(f"  {launcher.label:13}: every worker stopped {s.stopped:6.3f}s, every "
                        f"agent reacted {s.reacted:6.3f}s, every rank stepping again "
                        f"{s.stepping:6.2f}s")
                return s.stepping

            cfg.log(f"{NODES} nodes x {NPROC} workers, {case.step_time}s steps, SIGKILL of rank "
                    f"{VICTIM}, {case.rounds} launch(es) each ...")
            interleaved(list(subjects), one, case.rounds)
        for steps, seen in checksums.items():
            if len(seen) != 1:
                raise BenchError(f"launches of {steps} steps ended with different final "
                                 f"checksums {sorted(seen)}; a restart resumed wrongly")
    finally:
        shutil.rmtree(base, ignore_errors=True)

    def measured(case: Case, key: str, pick: str) -> Measured:
        ss = got[(case, key)]
        extra: dict[str, Any] = {"launches": [s.to_json() for s in ss]} if pick == "stopped" else {}
        return Measured(subjects[key].label, [float(getattr(s, pick)) for s in ss], extra)

    rows = [
        Comparison({"step": f"{case.step_time:g}s", "measure": measure},
                   measured(case, ELASTICTK.key, pick), measured(case, TORCHRUN.key, pick),
                   REF_NOTE)
        for case in cases
        for measure, pick in (("every worker on every node stopped", "stopped"),
                              ("every agent reacted (logged why it stops)", "reacted"),
                              ("every rank stepping again", "stepping"))
    ]
    notes: list[str] = []
    for case in cases:
        for key, launcher in subjects.items():
            notes += sample_notes(f"{launcher.label}, {case.step_time:g}s steps", launcher.kind,
                                  got[(case, key)], VICTIM)
    for key, n in frozen.items():
        notes.append(freeze_note(subjects[key].label, n, WORLD, FREEZE_CAP))
    for row in rows:
        if row.case["measure"].startswith("every agent reacted"):
            ours = row.ours.stats.median
            verdict = "meets" if ours <= TARGET_S else "misses"
            notes.append(f"target (every agent reacts within {TARGET_S * 1000:.0f} ms of the "
                         f"kill), {row.case['step']} steps: median {ours * 1000:.0f} ms, so "
                         f"elastictk-run {verdict} it")
    notes.append(
        "job: examples/train.py, checkpoint every "
        f"{CKPT_EVERY} steps, a sleep of the step time after each step's all_reduce; rank "
        f"{VICTIM} is killed a random fraction of a step after every rank passed step "
        f"{CKPT_EVERY}; every launch exited 0 on all {NODES} nodes, with final checksum "
        + ", ".join(f"{next(iter(checksums[c.steps]))} after {c.steps} steps" for c in cases))
    notes.append(f"{os.cpu_count()} cores for {NODES} agents and {WORLD} workers: stop times "
                 "include the teardown of Python processes that imported torch, and restart "
                 "times are dominated by starting workers on an oversubscribed CPU")
    return BenchResult(
        name="propagation",
        title=TITLE,
        description=(__doc__ or "").split("\n", 1)[1].strip(),
        unit="s",
        higher_is_better=False,
        rows=rows,
        notes=notes,
        params={"nodes": NODES, "nproc_per_node": NPROC, "victim_rank": VICTIM,
                "cases": [asdict(c) for c in cases], "ckpt_every": CKPT_EVERY,
                "max_restarts": MAX_RESTARTS, "rdzv_conf": RDZV_CONF,
                "freeze_cap_s": None if cfg.quick else FREEZE_CAP, "quick": cfg.quick},
        pids=sorted(set(pids)),
    )

"""Stragglers: how long after a rank turns slow the leader names it, by how much slower it is.

A job of 3 ranks (``elastictk-run --standalone --nproc-per-node 3 --straggler-action report``,
``bench/_straggler_worker.py``: a gloo all-reduce per step, ``T`` seconds of each rank's own work
per step) runs until every rank is stepping; from step ``K`` on, rank 1 gets a ``slow:<s>`` fault
at every step (a fault plan in ``ELASTICTK_FAULT_PLAN``, ``s = (F - 1) * T``), so its own time
per step is ``F`` times the others'. The sample is the time from its first ``slow`` fault (the
fault log's ``monotonic`` stamp) to the agent's ``straggler`` event naming it (the event's
``mono``; one host, one clock), in seconds and in windows of ``--straggler-interval``.

Factors below ``--straggler-threshold`` must never be named, and a fault-free control run (the
same job, no plan; its "start" is rank 0 reaching step ``K``) must name no one: a run not named
within ``OBSERVE_WINDOWS`` windows counts as "never named", which is a result, reported in the
notes. A run that names another rank than the slow one is reported too.

There is no torch equivalent: torchrun has no straggler detection (a slow rank only shows as a
slower job). The reference column is therefore the design's own floor, ``windows x interval``
(a straggler must be past the threshold for ``--straggler-windows`` consecutive windows), so the
last column says how close detection comes to it; the window it starts in may already count,
which is how detection can beat the floor.

The detection's cost is measured in the same run on a real TCPStore: per interval every agent
writes one sealed record and the leader reads one per member (O(nodes) store operations per
interval, none per step); the notes give the counted operations and the leader's time per
interval for 1, 8 and 32 simulated members (``StragglerWatch``'s own publish and score).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, cast

from .common import BenchError, BenchResult, Comparison, Measured, RunConfig, fmt, interleaved

TITLE = "Stragglers: time from a slow: straggler starting to the event naming it, by slowdown factor"
ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "bench" / "_straggler_worker.py")
NPROC, SLOW_RANK = 3, 1
STEP_TIME = 0.02
SLOW_FROM = 20  # the step the straggler starts at
THRESHOLD, WINDOWS = 1.5, 3  # elastictk-run's defaults
START_TIMEOUT, EXIT_TIMEOUT = 120.0, 60.0
CONTROL = "none (control)"


@dataclass
class Sample:
    start: float  # monotonic: the first slow fault (or, in the control, rank 0 at SLOW_FROM)
    named: Optional[float]  # seconds after start of the first straggler event; None: never
    ranks: list[int]  # every rank named during the observation
    slowdown: Optional[float]  # what the first event said
    pids: list[int]


def _plan(path: Path, factor: float, steps: int) -> None:
    extra = round((factor - 1) * STEP_TIME, 6)
    faults = [{"kind": f"slow:{extra:g}", "target": f"rank:{SLOW_RANK}", "at_step": s}
              for s in range(SLOW_FROM, SLOW_FROM + steps)]
    path.write_text(json.dumps({"schema": "elastictk.fault-plan/1", "faults": faults}))


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def _launch(factor: Optional[float], work: Path, interval: float, observe: int) -> Sample:
    """One job: wait for the straggler to start, watch ``observe`` windows for the event."""
    work.mkdir()
    events, faults, log = work / "events.jsonl", work / "faults.jsonl", work / "agent.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICTK_", "PET_"))}
    env.update(TMPDIR=str(work), ELASTICTK_FAULT_LOG=str(faults))
    if factor is not None:
        plan = work / "plan.json"
        _plan(plan, factor, steps=int(observe * interval / (factor * STEP_TIME)) + 200)
        env["ELASTICTK_FAULT_PLAN"] = str(plan)
    argv = [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", str(NPROC),
            "--straggler-action", "report", "--straggler-interval", f"{interval:g}",
            "--straggler-windows", str(WINDOWS), "--straggler-threshold", f"{THRESHOLD:g}",
            "--event-log", str(events), "--log-dir", str(work / "logs"), WORKER, str(work),
            "--step-time", str(STEP_TIME), "--mark-at", str(SLOW_FROM)]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        start = _wait(proc, log, START_TIMEOUT, lambda: _started(factor, work, faults))
        deadline = start + observe * interval
        while time.monotonic() < deadline and proc.poll() is None:
            if _straggler_events(events):
                break
            time.sleep(0.05)
        (work / "stop").touch()
        code = proc.wait(EXIT_TIMEOUT)
        if code != 0:
            raise BenchError(f"elastictk-run exited {code}; {_tail(log)}")
        named = [e for e in _straggler_events(events) if e["mono"] <= deadline]
        first = named[0] if named else None
        return Sample(start, first["mono"] - start if first else None,
                      sorted({e["fields"]["rank"] for e in named}),
                      first["fields"].get("slowdown") if first else None, [proc.pid])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _started(factor: Optional[float], work: Path, faults: Path) -> Optional[float]:
    if factor is None:
        mark = work / "mark"
        text = mark.read_text().strip() if mark.exists() else ""
        return float(text) if text.endswith(tuple("0123456789")) and "\n" not in text else None
    slow = [r for r in _jsonl(faults) if str(r.get("kind", "")).startswith("slow:")]
    return float(slow[0]["monotonic"]) if slow else None


def _straggler_events(path: Path) -> list[dict[str, Any]]:
    return [e for e in _jsonl(path) if e.get("kind") == "straggler"]


def _wait(proc: "subprocess.Popen[bytes]", log: Path, timeout: float, pred: Any) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got is not None:
            return float(got)
        if proc.poll() is not None:
            raise BenchError(f"elastictk-run exited {proc.returncode} before the straggler started; "
                             f"{_tail(log)}")
        time.sleep(0.05)
    raise BenchError(f"the straggler did not start within {timeout:g}s; {_tail(log)}")


def _tail(log: Path) -> str:
    lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    return " / ".join(lines[-4:])[-600:]


# -- the cost: store operations per interval ---------------------------------------------------
class _Counting:
    """The two store calls sealed records make, counted (duck-typed for ``Records``)."""

    def __init__(self, store: Any) -> None:
        self.store, self.sets, self.gets = store, 0, 0

    def set(self, key: str, value: bytes) -> None:
        self.sets += 1
        self.store.set(key, value)

    def try_get(self, key: str) -> Optional[bytes]:
        self.gets += 1
        return cast(Optional[bytes], self.store.try_get(key))


def _cost(nodes: int, reps: int) -> tuple[int, int, float]:
    """(sets, gets) per interval for the whole job, and the leader's median seconds per interval
    (its publish and score), with ``nodes`` real StragglerWatch objects on one TCPStore."""
    from elastictk.agent.stragglers import StragglerWatch
    from elastictk.metrics.steps import WorkerStepsBlock
    from elastictk.rendezvous.auth import Signer
    from elastictk.rendezvous.sealed import Records
    from elastictk.store import Store
    from elastictk.store.tcp import TCPStore

    store = TCPStore.serve("127.0.0.1", 0)
    counting = _Counting(store)
    records = Records(cast(Store, counting), "bench/stragglers", Signer("bench-token", "bench", "r1"))
    members = [f"node{i}" for i in range(nodes)]
    blocks = [WorkerStepsBlock(1) for _ in members]
    watches = [StragglerWatch(b, {0: i}, records, node_id=n, members=members, leader=i == 0,
                              interval=3600.0, threshold=THRESHOLD, windows=WINDOWS,
                              emit=lambda *a, **k: None) for i, (n, b) in enumerate(zip(members, blocks))]
    try:
        leader_s: list[float] = []
        for _ in range(reps):
            for w in watches[1:]:
                w._publish()
            t = time.perf_counter()
            watches[0]._publish()
            watches[0]._score()
            leader_s.append(time.perf_counter() - t)
        return counting.sets // reps, counting.gets // reps, statistics.median(leader_s)
    finally:
        for w in watches:
            w.stop()
        for b in blocks:
            b.close()
        store.close()


# -- the run -----------------------------------------------------------------------------------
def _label(factor: Optional[float]) -> str:
    return CONTROL if factor is None else f"{factor:g}x"


def run(cfg: RunConfig) -> BenchResult:
    factors: tuple[Optional[float], ...] = (4.0, None) if cfg.quick else (1.25, 1.5, 2.0, 4.0, None)
    rounds = 1 if cfg.quick else 5
    interval = 0.5 if cfg.quick else 1.0
    observe = 6 if cfg.quick else 10
    base = Path(tempfile.mkdtemp(prefix="etk-bench-stragglers-"))
    got: dict[str, list[Sample]] = {_label(f): [] for f in factors}
    by_label = {_label(f): f for f in factors}
    pids: list[int] = []
    counter = iter(range(10_000))
    try:
        def one(label: str) -> float:
            s = _launch(by_label[label], base / f"{label.split()[0]}-{next(counter)}", interval, observe)
            got[label].append(s)
            pids.extend(s.pids)
            cfg.log(f"  {label:15} named {s.ranks or 'nobody'}"
                    + (f" after {s.named:.2f}s" if s.named is not None else f" within {observe} windows"))
            return s.named or 0.0

        cfg.log(f"{rounds} launch(es) per factor {', '.join(got)}; interval {interval:g}s, "
                f"{WINDOWS} windows, threshold {THRESHOLD:g}")
        interleaved(list(got), one, rounds)
        costs = [(n, *_cost(n, 3 if cfg.quick else 21)) for n in ((1, 8) if cfg.quick else (1, 8, 32))]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    floor = WINDOWS * interval
    rows: list[Comparison] = []
    notes: list[str] = []
    for label, samples in got.items():
        hit = [s for s in samples if s.named is not None and s.ranks == [SLOW_RANK]]
        wrong = [s for s in samples if s.ranks and s.ranks != [SLOW_RANK]]
        if by_label[label] is None:
            named = [s.ranks for s in samples if s.ranks]
            notes.append(f"{CONTROL}: named nobody in {len(samples) - len(named)} of {len(samples)} "
                         f"runs ({observe} windows watched each)"
                         + (f"; named ranks {named}" if named else ""))
            continue
        text = (f"{label}: rank {SLOW_RANK} named in {len(hit)} of {len(samples)} runs within "
                f"{observe} windows")
        if hit:
            secs = [s.named or 0.0 for s in hit]
            text += (f", median {fmt(statistics.median(secs) / interval)} windows "
                     f"({fmt(statistics.median(secs))} s), the event's slowdown median "
                     f"{fmt(statistics.median(s.slowdown or 0.0 for s in hit))}x")
            rows.append(Comparison({"slowdown": label, "named": f"{len(hit)}/{len(samples)}"},
                                   Measured("named after", secs,
                                            {"windows": [x / interval for x in secs],
                                             "slowdown": [s.slowdown for s in hit]}),
                                   Measured("floor: windows × interval", [floor] * len(hit)),
                                   "no torch equivalent (torchrun has no straggler detection): the "
                                   "reference is the design's floor, --straggler-windows × "
                                   "--straggler-interval"))
        if wrong:
            text += f"; another rank named in {len(wrong)} runs: {[s.ranks for s in wrong]}"
        notes.append(text)
    for n, sets, gets, leader_s in costs:
        notes.append(f"cost, {n} node(s): {sets} sealed writes (one per node) and {gets} reads (the "
                     f"leader's, one per member) per interval, none per step; the leader's publish "
                     f"and score take {fmt(leader_s * 1000)} ms per interval on a TCPStore on loopback")
    notes.append(f"job: {NPROC} ranks, {STEP_TIME}s of own work per step, rank {SLOW_RANK} slow from "
                 f"step {SLOW_FROM}; --straggler-interval {interval:g} (5 by default: detection "
                 f"scales with it), --straggler-windows {WINDOWS}, --straggler-threshold {THRESHOLD:g}")
    return BenchResult(
        name="stragglers", title=TITLE, description=(__doc__ or "").split("\n", 1)[1].strip(),
        unit="s", higher_is_better=False, rows=rows, notes=notes,
        params={"factors": [_label(f) for f in factors], "rounds": rounds, "interval": interval,
                "windows": WINDOWS, "threshold": THRESHOLD, "observe_windows": observe,
                "nproc": NPROC, "step_time": STEP_TIME, "quick": cfg.quick},
        pids=sorted(set(pids)),
    )

"""``python -m bench soak [--quick] [--runs N] [--seed S] [--parallel P]``: many seeded
``elastictk-chaos`` runs, and whether restart semantics held in every one of them.

Each run is a real ``elastictk-chaos`` process (plan generated from its seed, job under
``elastictk-run``) from the matrix in ``bench/_soak_matrix.py``: every fault kind, single-node
restart-all and in-place, several nodes over c10d and over etcd, scripts of different shapes.
What a run did is read from its own ``chaos-report.json`` (``bench/_soak_tally.py``): exit code,
faults planned and fired, invariants broken, processes and shared memory or ports left over,
whether it was stopped by its timeout, wall time. The soak adds one check of its own: every
process of a run carries a marker in its environment, and any still alive once
``elastictk-chaos`` has exited is an orphan (it is then killed, by PID).

A full soak writes ``bench/results/soak.md`` and ``soak.json`` and must reach >= 100 runs and
>= 1000 fired faults with zero unfired faults, broken invariants, orphans, leaks and timeouts.
``--quick`` (one run per scenario, a few minutes) is the check to run after touching recovery
code; it writes nothing to ``bench/results``. A full soak stopped by SIGTERM/SIGINT/SIGHUP stops
its running chaos runs (they stop their jobs) and writes the runs that finished, saying so. Exit 0 when the verdict passes, 1 when not (the
failed runs' report directories are kept and named), 2 for bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import psutil

from ._soak_matrix import ROOT, SCENARIOS, SCHEDULE, Scenario, scenario_of
from ._soak_tally import RunResult, Totals, markdown, passed, read_run, verdict
from .common import RESULTS_DIR, BenchError, RunConfig, BenchResult, loadavg, machine_info, now_text, write_atomic

TITLE = "Soak: seeded elastictk-chaos runs across every fault kind and mode"
PROG = "python -m bench soak"
MARKER = "ELASTICTK_SOAK_RUN"
FULL_RUNS = 120  # the schedule 10 times: >= 1000 faults fired
MAX_PARALLEL = 2  # a run is a handful of processes; more at once starves a 2-core machine
KILL_GRACE_S = 90.0  # past the run's own --timeout, before the soak stops elastictk-chaos itself


def run(cfg: RunConfig) -> BenchResult:
    """The registry's entry point; the soak has its own command line and report."""
    raise BenchError(f"the soak runs on its own: {PROG} [--quick] [--runs N] [--seed S]")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--quick", action="store_true", help="one run per scenario (a few minutes); "
                   "writes nothing to bench/results")
    p.add_argument("--runs", type=int, default=None,
                   help=f"how many runs (default {FULL_RUNS}, --quick {len(SCENARIOS)})")
    p.add_argument("--seed", type=int, default=0, help="seed of run 0; run i uses seed+i (default 0)")
    p.add_argument("--parallel", type=int, default=1, help=f"runs at once, 1..{MAX_PARALLEL} (default 1)")
    p.add_argument("--only", default=None, help="comma-separated scenarios to cycle through "
                   f"(default all: {', '.join(s.name for s in SCENARIOS)})")
    p.add_argument("--out", type=Path, default=None, help="keep every run's report directory here "
                   "(default: a temporary directory; only failed runs' are kept)")
    p.add_argument("--report", type=Path, default=None, help="write the markdown report here too "
                   "(a full soak always writes bench/results/soak.md)")
    return p


class Usage(Exception):
    pass


def _check(ns: argparse.Namespace) -> list[str] | None:
    if ns.runs is not None and ns.runs < 1:
        raise Usage(f"--runs {ns.runs}: give at least 1")
    if not 1 <= ns.parallel <= MAX_PARALLEL:
        raise Usage(f"--parallel {ns.parallel}: give 1..{MAX_PARALLEL} (each run is several processes; "
                    "more at once only makes runs time out on a small machine)")
    if ns.only is None:
        return None
    only = [x.strip() for x in ns.only.split(",") if x.strip()]
    unknown = [x for x in only if x not in {s.name for s in SCENARIOS}]
    if unknown or not only:
        raise Usage(f"--only {ns.only!r}: no scenario {', '.join(unknown) or '(empty)'}; choose from "
                    + ", ".join(s.name for s in SCENARIOS))
    return only


class Soak:
    """Runs chaos runs, at most ``parallel`` at a time, and stops them all on a signal."""

    def __init__(self, out: Path, keep: bool, orphan_grace: float = 5.0) -> None:
        self.out, self.keep, self.orphan_grace = out, keep, orphan_grace
        self.tag = uuid.uuid4().hex[:12]
        self.stop = threading.Event()
        self.live: dict[int, subprocess.Popen[bytes]] = {}
        self.lock = threading.Lock()
        self.judged: dict[str, list[bool]] = {}  # a scenario's required check -> its verdict per run

    def one(self, index: int, scenario: Scenario, seed: int) -> Optional[RunResult]:
        if self.stop.is_set():
            return None
        out = self.out / f"run{index:03d}-{scenario.name}-seed{seed}"
        out.mkdir(parents=True, exist_ok=True)
        argv = scenario.argv(seed, out)
        marker = f"{self.tag}-{index}"
        env = {**os.environ, MARKER: marker}
        start = time.monotonic()
        killed = False
        with open(out / "soak-stdout.log", "wb") as so, open(out / "soak-stderr.log", "wb") as se:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=so, stderr=se, stdin=subprocess.DEVNULL)
            with self.lock:
                self.live[index] = proc
            try:
                proc.wait(scenario.timeout + KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                killed = True
                _stop(proc)
            finally:
                with self.lock:
                    self.live.pop(index, None)
        wall = time.monotonic() - start
        orphans = _orphans(marker, self.orphan_grace)
        if self.stop.is_set() and not killed:  # stopped by the soak's signal: not a run to count
            if not self.keep:
                shutil.rmtree(out, ignore_errors=True)
            return None
        cmd = shlex.join([a if a != sys.executable else "python" for a in argv]).replace(str(out), "OUT")
        r = read_run(out, index=index, scenario=scenario.name, mode=scenario.mode, script=scenario.script,
                     seed=seed, exit_code=proc.returncode, wall_s=wall, command=cmd, killed=killed,
                     orphans=orphans)
        self._judged(r, scenario, out)
        if r.ok and not self.keep:
            shutil.rmtree(out, ignore_errors=True)
        return r

    def _judged(self, r: RunResult, scenario: Scenario, out: Path) -> None:
        """The checks ``scenario`` must have judged: one missing from the report is broken (a
        run that never judged the data, say, proves nothing about it)."""
        if not scenario.judged or r.error is not None:
            return
        try:
            checks = {c.get("name"): c for c in json.loads((out / "chaos-report.json").read_text())["checks"]}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            checks = {}
        for name in scenario.judged:
            got = checks.get(name)
            with self.lock:
                self.judged.setdefault(name, []).append(bool(got and got.get("ok")))
            if got is None:
                r.broken.append(f"{name}: not judged (the report holds no such check)")

    def interrupt(self) -> None:
        """Stop: no new run starts; every running elastictk-chaos gets SIGTERM (it stops its job)."""
        self.stop.set()
        with self.lock:
            procs = list(self.live.values())
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)


def _stop(proc: "subprocess.Popen[bytes]") -> None:
    proc.send_signal(signal.SIGTERM)  # elastictk-chaos stops its job's processes, then exits
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _orphans(marker: str, grace: float = 5.0) -> list[str]:
    """Processes of this run (they carry ``marker`` in their environment) still alive once
    elastictk-chaos exited; after ``grace`` seconds, each is named and killed."""
    deadline = time.monotonic() + grace
    while True:
        found = []
        for p in psutil.process_iter(["pid", "name"]):
            try:
                if p.environ().get(MARKER) == marker and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except (psutil.Error, OSError):
                continue
        if not found or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    out = []
    for p in found:
        try:
            out.append(f"pid {p.pid} ({' '.join(p.cmdline())[:80]})")
            p.kill()
        except psutil.Error:
            continue
    end = time.monotonic() + 5  # dead within moments (a zombie until whoever adopted it reaps it)
    while time.monotonic() < end and any(_alive(p) for p in found):
        time.sleep(0.05)
    return out


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def main(argv: Optional[list[str]] = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        only = _check(ns)
    except Usage as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    runs = ns.runs or (len(only or SCENARIOS) if ns.quick else FULL_RUNS)
    full = not ns.quick
    keep = ns.out is not None
    out = ns.out if keep else Path(tempfile.mkdtemp(prefix="elastictk-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    soak = Soak(out, keep)
    stopped: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        stopped.append(signum)
        soak.interrupt()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    machine = {**machine_info(), "loadavg_at_start": loadavg()}
    started, when = time.monotonic(), now_text()
    plan = [(i, scenario_of(i, only), ns.seed + i) for i in range(runs)]
    print(f"{PROG}: {runs} run(s), {ns.parallel} at a time, seeds {ns.seed}..{ns.seed + runs - 1}; "
          f"run directories under {out}", file=sys.stderr, flush=True)
    results: list[RunResult] = []
    try:
        with ThreadPoolExecutor(ns.parallel) as pool:
            futures = [pool.submit(soak.one, *job) for job in plan]
            for f in futures:
                while not f.done():  # wake for signals
                    time.sleep(0.2)
                r = f.result()
                if r is None:
                    continue
                results.append(r)
                _progress(r, len(results), runs, time.monotonic() - started)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    results.sort(key=lambda r: r.index)
    machine["loadavg_at_end"] = loadavg()
    checks = verdict(results, full)
    header = _header(ns, runs, machine, when, time.monotonic() - started, only)
    if stopped:  # what finished before the signal still counts; runs cut short do not
        header.insert(0, f"Stopped by {signal.Signals(stopped[0]).name} after {len(results)} of {runs} "
                      "planned runs (the runs it cut short are left out).\n")
        print(f"{PROG}: stopped by {signal.Signals(stopped[0]).name} after {len(results)} run(s)",
              file=sys.stderr)
    text = markdown(results, checks, title=TITLE + ("" if full else " (quick)"), header=header)
    if full and results:
        write_atomic(RESULTS_DIR / "soak.md", text)
        data = {"totals": Totals.of(results).__dict__, "verdict": [c.__dict__ for c in checks],
                "machine": machine, "when": when, "runs": [r.to_json() for r in results]}
        write_atomic(RESULTS_DIR / "soak.json", json.dumps(data, indent=2) + "\n")
        print(f"{PROG}: wrote {RESULTS_DIR / 'soak.md'} and soak.json", file=sys.stderr)
    if ns.report is not None:
        write_atomic(ns.report, text)
    print(f"\n{Totals.of(results).line()}")
    for c in checks:
        print(f"  [{'ok' if c.ok else 'FAILED'}] {c.name}: {c.detail}")
    for name, oks in soak.judged.items():
        print(f"  judged in {len(oks)} run(s), {oks.count(False)} broken: {name}")
    kept = [r for r in results if not r.ok]
    if kept:
        print(f"{PROG}: the failed runs' reports are in {out}: "
              + ", ".join(f"run{r.index:03d}-{r.scenario}-seed{r.seed}" for r in kept), file=sys.stderr)
    elif not keep:
        shutil.rmtree(out, ignore_errors=True)
    if stopped:
        return 128 + stopped[0]
    return 0 if passed(checks) else 1


def _progress(r: RunResult, done: int, runs: int, elapsed: float) -> None:
    what = "ok" if r.ok else "FAILED (" + "; ".join(
        x for x in (r.error, f"{len(r.unfired)} unfired" if r.unfired else None,
                    f"broken: {', '.join(b.split(':')[0] for b in r.broken)}" if r.broken else None,
                    f"{len(r.orphans)} orphan(s)" if r.orphans else None,
                    f"{len(r.leaks)} leak(s)" if r.leaks else None, "timed out" if r.timeout else None,
                    f"chaos exit {r.exit_code}" if r.exit_code else None) if x) + ")"
    print(f"[{elapsed:6.0f}s] {done:3d}/{runs} #{r.index} {r.scenario} seed {r.seed}: {what}; "
          f"{r.fired}/{r.planned} fired, {r.restarts} restart(s), {r.wall_s:.1f}s", file=sys.stderr, flush=True)


def _header(ns: argparse.Namespace, runs: int, machine: dict[str, Any], when: str, elapsed: float,
            only: Optional[list[str]]) -> list[str]:
    cmd = " ".join([PROG, *(["--quick"] if ns.quick else []), "--runs", str(runs), "--seed", str(ns.seed),
                    "--parallel", str(ns.parallel), *(["--only", ",".join(only)] if only else [])])
    scen = [s for s in SCENARIOS if only is None or s.name in only]
    pool = [n for n in SCHEDULE if only is None or n in only]
    return [
        f"`{cmd}`, {when}; {elapsed / 60:.1f} min in all. Run i is entry i mod {len(pool)} of the schedule "
        f"({', '.join(pool)}) with seed {ns.seed}+i; every figure below comes from that run's own chaos-report.json (orphans also from "
        "a scan for processes carrying the run's environment marker after it ended).",
        "",
        f"Machine: {machine.get('cpu_model')}, {machine.get('cores')} cores, torch {machine.get('torch')}; "
        f"load average {machine.get('loadavg_at_start')} at the start, {machine.get('loadavg_at_end')} at "
        "the end (the machine is shared).",
        "",
        "Scenarios (`{seed}`/`{plan}` per run; `{run_dir}` is the run's own directory):",
        "",
        *[f"- **{s.name}** ({s.mode}, {s.trigger} faults: {s.kinds}): `elastictk-chaos "
          + ("--plan {plan}" if s.time_plan else "--seed {seed}") + " "
          + shlex.join([*s.chaos, *s.launcher, "--", *s.command]) + "`"
          + (f" — plan: {s.time_plan.count} faults in {s.time_plan.window[0]:g}-{s.time_plan.window[1]:g}s, "
             f"at least {s.time_plan.gap:g}s apart" if s.time_plan else "") for s in scen],
    ]


if __name__ == "__main__":
    sys.exit(main())

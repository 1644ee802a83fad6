"""The soak's bookkeeping: one :class:`RunResult` per chaos run, read from that run's own
``chaos-report.json`` (never re-derived), the totals, the verdict and the markdown report.

Kept apart from the process handling in ``bench/soak.py`` so the counting can be checked on canned
reports (``tests/test_bench_soak.py``): a run with an unfired fault, a broken invariant, an orphan,
a leak or a timeout must turn the verdict red.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

FIRED = "every planned fault fired"
ORPHANS = "no process of the job outlives the run"
LEAKS = "no leaked shared memory or listening port"
#: A full soak's target (issue #18); ``--quick`` keeps only the zeros.
MIN_RUNS, MIN_FIRED = 100, 1000


@dataclass
class RunResult:
    """What one chaos run did, as its report says (plus what the soak saw around it)."""

    index: int
    scenario: str
    mode: str
    script: str
    seed: int
    exit_code: Optional[int]  # elastictk-chaos's own exit code (0: every invariant held)
    wall_s: float
    planned: int = 0
    fired: int = 0
    restarts: int = 0
    job_exit: Optional[int] = None  # the training job's exit (it may fail by design: budget spent)
    unfired: list[str] = field(default_factory=list)  # "#i kind on target at when: why"
    broken: list[str] = field(default_factory=list)  # "name: detail", the fired check left out
    orphans: list[str] = field(default_factory=list)  # processes alive after the run
    leaks: list[str] = field(default_factory=list)  # shared memory segments, listening ports
    timeout: bool = False
    error: Optional[str] = None  # no report: the run never got to write one
    command: str = ""

    @property
    def ok(self) -> bool:
        return (self.exit_code == 0 and not self.unfired and not self.broken and not self.orphans
                and not self.leaks and not self.timeout and self.error is None)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def read_run(report_dir: Path, *, index: int, scenario: str, mode: str, script: str, seed: int,
             exit_code: Optional[int], wall_s: float, command: str = "", killed: bool = False,
             orphans: Optional[list[str]] = None) -> RunResult:
    """The result of one run from its ``chaos-report.json``; ``killed``: the soak had to stop
    elastictk-chaos itself (a timeout), ``orphans``: processes of the run the soak found alive."""
    r = RunResult(index, scenario, mode, script, seed, exit_code, wall_s, timeout=killed, command=command)
    path = report_dir / "chaos-report.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict):
        r.error = "no chaos-report.json" + ("" if exit_code is None else f" (elastictk-chaos exit {exit_code})")
        r.orphans = list(orphans or [])
        return r
    tot = data.get("totals") or {}
    faults = data.get("faults") or []
    r.planned = int(tot.get("faults_planned", len(faults)))
    r.fired = int(tot.get("faults_fired", sum(1 for f in faults if f.get("fired"))))
    r.restarts = int(tot.get("restarts") or 0)
    r.job_exit = tot.get("exit_code")
    r.timeout = killed or tot.get("stopped") == "timeout"
    checks = data.get("checks") or []
    fired_check = next((c for c in checks if c.get("name") == FIRED), None)
    missed = [f for f in faults if not f.get("fired")]
    # Faults planned past --max-restarts are not expected to fire: the fired check says so.
    if missed and (fired_check is None or not fired_check.get("ok")):
        r.unfired = [f"#{f.get('index')} {f.get('kind')} on {f.get('target')} at {f.get('planned')}: "
                     f"{f.get('why')}" for f in missed]
    r.broken = [f"{c.get('name')}: {c.get('detail')}" for c in checks
                if not c.get("ok") and c.get("name") != FIRED]
    seen = {int(m.group(1)): m.group(0) for c in checks if c.get("name") == ORPHANS and not c.get("ok")
            for m in re.finditer(r"pid (\d+)", str(c.get("detail")))}
    for o in orphans or []:
        m = re.match(r"pid (\d+)", o)
        seen[int(m.group(1)) if m else -len(seen) - 1] = o
    r.orphans = [seen[k] for k in sorted(seen)]
    r.leaks = [x.strip() for c in checks if c.get("name") == LEAKS and not c.get("ok")
               for x in str(c.get("detail")).split(", ") if x.strip()]
    return r


@dataclass(frozen=True)
class Totals:
    runs: int
    passed: int
    planned: int
    fired: int
    unfired: int
    broken: int
    orphans: int
    leaks: int
    timeouts: int
    errors: int
    restarts: int
    wall_s: float

    @classmethod
    def of(cls, results: list[RunResult]) -> "Totals":
        return cls(
            runs=len(results), passed=sum(r.ok for r in results),
            planned=sum(r.planned for r in results), fired=sum(r.fired for r in results),
            unfired=sum(len(r.unfired) for r in results), broken=sum(len(r.broken) for r in results),
            orphans=sum(len(r.orphans) for r in results), leaks=sum(len(r.leaks) for r in results),
            timeouts=sum(r.timeout for r in results), errors=sum(r.error is not None for r in results),
            restarts=sum(r.restarts for r in results), wall_s=sum(r.wall_s for r in results))

    def line(self) -> str:
        return (f"{self.runs} run(s), {self.passed} passed; faults {self.fired} fired of {self.planned} "
                f"planned ({self.unfired} unfired); {self.restarts} restart(s); {self.broken} broken "
                f"invariant(s), {self.orphans} orphan(s), {self.leaks} leak(s), {self.timeouts} timeout(s), "
                f"{self.errors} error(s); {self.wall_s:.0f}s of runs")


@dataclass(frozen=True)
class Verdict:
    name: str
    ok: bool
    detail: str


def verdict(results: list[RunResult], full: bool) -> list[Verdict]:
    """The soak's checks: zeros everywhere, every chaos run exit 0; a full soak also needs
    >= MIN_RUNS runs and >= MIN_FIRED fired faults."""
    t = Totals.of(results)
    bad = [r for r in results if r.exit_code != 0]
    out = []
    if full:
        out += [Verdict(f"at least {MIN_RUNS} runs", t.runs >= MIN_RUNS, f"{t.runs} run(s)"),
                Verdict(f"at least {MIN_FIRED} fired faults", t.fired >= MIN_FIRED, f"{t.fired} fired")]
    out += [
        Verdict("every planned fault fired", t.unfired == 0, _where(results, "unfired", t.unfired)),
        Verdict("no broken invariant", t.broken == 0, _where(results, "broken", t.broken)),
        Verdict("no orphan process", t.orphans == 0, _where(results, "orphans", t.orphans)),
        Verdict("no leaked shared memory or port", t.leaks == 0, _where(results, "leaks", t.leaks)),
        Verdict("no timeout", t.timeouts == 0, f"{t.timeouts}" + _runs([r for r in results if r.timeout])),
        Verdict("every run reported", t.errors == 0,
                f"{t.errors}" + _runs([r for r in results if r.error is not None])),
        Verdict("every elastictk-chaos run exit 0", not bad,
                f"{len(bad)} not" + _runs(bad) if bad else f"all {t.runs}"),
    ]
    return out


def _where(results: list[RunResult], attr: str, total: int) -> str:
    return f"{total}" + _runs([r for r in results if getattr(r, attr)])


def _runs(rs: list[RunResult]) -> str:
    return "" if not rs else " (run " + ", ".join(f"#{r.index} {r.scenario} seed {r.seed}" for r in rs[:8]) \
        + (", ..." if len(rs) > 8 else "") + ")"


def passed(checks: list[Verdict]) -> bool:
    return all(c.ok for c in checks)


def _cell(x: Any) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def _table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def by_scenario(results: list[RunResult]) -> list[list[Any]]:
    rows = []
    for name in dict.fromkeys(r.scenario for r in results):
        rs = [r for r in results if r.scenario == name]
        t = Totals.of(rs)
        rows.append([name, rs[0].mode, rs[0].script, t.runs, t.passed, f"{t.fired}/{t.planned}", t.restarts,
                     t.broken, t.orphans, t.leaks, t.timeouts, f"{max(r.wall_s for r in rs):.1f}s"])
    return rows


def markdown(results: list[RunResult], checks: list[Verdict], *, title: str, header: list[str]) -> str:
    """The soak report: verdict, totals, per scenario, per run, then what each failed run broke."""
    t = Totals.of(results)
    out = [f"# {title}", "", *header, "",
           f"**{'PASS' if passed(checks) else 'FAIL'}**: {t.line()}", ""]
    out += [f"- [{'ok' if c.ok else 'FAILED'}] {c.name}: {c.detail}" for c in checks]
    out += ["", "## Totals", "", _table(
        ["runs", "passed", "faults planned", "fired", "unfired", "restarts", "broken invariants",
         "orphans", "leaks", "timeouts", "errors", "wall time of runs"],
        [[t.runs, t.passed, t.planned, t.fired, t.unfired, t.restarts, t.broken, t.orphans, t.leaks,
          t.timeouts, t.errors, f"{t.wall_s:.0f}s"]])]
    out += ["", "## Per scenario", "", _table(
        ["scenario", "mode", "script", "runs", "passed", "fired/planned", "restarts", "broken", "orphans",
         "leaks", "timeouts", "longest run"], by_scenario(results))]
    out += ["", "## Per run", "", _table(
        ["#", "scenario", "seed", "chaos exit", "job exit", "planned", "fired", "restarts", "broken",
         "orphans", "leaks", "timeout", "wall"],
        [[r.index, r.scenario, r.seed, r.exit_code, r.job_exit, r.planned, r.fired, r.restarts, len(r.broken),
          len(r.orphans), len(r.leaks), "yes" if r.timeout else "-", f"{r.wall_s:.1f}s"] for r in results])]
    failed = [r for r in results if not r.ok]
    if failed:
        out += ["", "## Failed runs", ""]
        for r in failed:
            out.append(f"- #{r.index} {r.scenario} seed {r.seed} (chaos exit {r.exit_code}): `{r.command}`")
            out += [f"  - {what}: {x}" for what, xs in (("unfired", r.unfired), ("broken", r.broken),
                                                         ("orphan", r.orphans), ("leak", r.leaks)) for x in xs]
            if r.timeout:
                out.append("  - timed out")
            if r.error:
                out.append(f"  - {r.error}")
    return "\n".join(out) + "\n"

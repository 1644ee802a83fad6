"""What every benchmark shares: interleaved sampling, robust statistics, ratios, tables, files.

These machines are shared and noisy: absolute numbers drift by tens of percent between runs,
so a benchmark never trusts one measurement. It takes many samples of elastictk and of the torch
counterpart *interleaved* (A B A B ..., with the order reversed every other round so neither side
always runs right after the other), reports medians with their interquartile range, and states
the ratio in words that say which side is better. Ratios hold where absolute times do not.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

RESULTS_DIR = Path(__file__).resolve().parent / "results"


class BenchError(RuntimeError):
    """A benchmark could not run (a store misbehaved, a client died); one line says why."""


@dataclass(frozen=True)
class RunConfig:
    """How hard a benchmark should work; ``quick`` is a seconds-long smoke run."""

    quick: bool = False
    rounds: int = 15  # samples per subject; odd, so the median is a real sample
    sample_seconds: float = 0.2  # aim for samples this long, so timer and signalling noise vanish
    log: Callable[[str], None] = field(default_factory=lambda: _stderr_log(time.monotonic()))

    @classmethod
    def make(cls, quick: bool) -> "RunConfig":
        if quick:
            return cls(quick=True, rounds=3, sample_seconds=0.01)
        return cls()


def _stderr_log(start: float) -> Callable[[str], None]:
    def log(msg: str) -> None:
        print(f"[{time.monotonic() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return log


@dataclass(frozen=True)
class Stats:
    """Median, quartiles and range of one subject's samples."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Stats":
        if not samples:
            raise BenchError("no samples were taken")
        xs = sorted(samples)
        if len(xs) >= 2:
            q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        else:
            q1 = q3 = xs[0]
        return cls(statistics.median(xs), q1, q3, xs[0], xs[-1], len(xs))


@dataclass
class Measured:
    """One subject (an elastictk part or its torch counterpart) in one case."""

    label: str
    samples: list[float]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def stats(self) -> Stats:
        return Stats.of(self.samples)


@dataclass
class Comparison:
    """One table row: elastictk against its reference, for one case (e.g. op=set, clients=16)."""

    case: dict[str, str]
    ours: Measured
    ref: Measured
    note: str = ""


@dataclass
class BenchResult:
    """What a benchmark's ``run`` returns; the runner adds the machine and writes the files.

    ``unit`` names what a sample measures and ``higher_is_better`` which way is good, so the
    runner can phrase every ratio as "×N faster" or "×N slower" for elastictk.
    """

    name: str
    title: str
    description: str
    unit: str
    higher_is_better: bool
    rows: list[Comparison]
    notes: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    # Every helper process the benchmark started, so a caller can check none outlived it.
    pids: list[int] = field(default_factory=list)


# -- sampling ----------------------------------------------------------------------------------
def interleaved(
    subjects: Sequence[str], sample: Callable[[str], float], rounds: int
) -> dict[str, list[float]]:
    """``rounds`` samples of each subject, taken round-robin: A B C, C B A, A B C, ...

    Reversing every other round keeps a slow drift of the machine (another job starting, a
    thermal step) from always landing on the same subject.
    """
    out: dict[str, list[float]] = {s: [] for s in subjects}
    for r in range(rounds):
        order = list(subjects) if r % 2 == 0 else list(reversed(subjects))
        for s in order:
            out[s].append(sample(s))
    return out


def ratio(ours: Stats, ref: Stats, higher_is_better: bool) -> float:
    """How many times better elastictk is (> 1: elastictk better, < 1: torch better)."""
    if higher_is_better:
        return ours.median / ref.median if ref.median else float("inf")
    return ref.median / ours.median if ours.median else float("inf")


def overlap(a: Stats, b: Stats) -> bool:
    """Whether the interquartile ranges overlap: the difference is within this machine's noise."""
    return a.q1 <= b.q3 and b.q1 <= a.q3


def ratio_text(ours: Stats, ref: Stats, higher_is_better: bool) -> str:
    """``×3.10 faster`` / ``×1.25 slower`` for elastictk, marked when within the noise."""
    r = ratio(ours, ref, higher_is_better)
    text = f"×{r:.2f} faster" if r >= 1 else f"×{1 / r:.2f} slower"
    return text + (" (IQRs overlap)" if overlap(ours, ref) else "")


# -- presentation ------------------------------------------------------------------------------
def fmt(x: float) -> str:
    """Three significant digits, thousands separated: 12,300 / 45.6 / 0.0789."""
    if x == 0 or not (x == x) or abs(x) == float("inf"):
        return str(x)
    if abs(x) >= 100:
        return f"{round(x, -max(0, len(str(int(abs(x)))) - 3)):,.0f}"
    return f"{x:.3g}"


def fmt_stats(s: Stats) -> str:
    return f"{fmt(s.median)} [{fmt(s.q1)}–{fmt(s.q3)}]"


_SUPERSCRIPTS = "¹²³⁴⁵⁶⁷⁸⁹"


def markdown_table(result: BenchResult) -> str:
    """The comparison table: one row per case, medians with IQR and the worded ratio."""
    case_cols = list(result.rows[0].case) if result.rows else []
    head = case_cols + [
        "elastictk", f"{result.unit} median [IQR]",
        "reference", f"{result.unit} median [IQR]", "elastictk vs reference",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    marks = {note: _SUPERSCRIPTS[i % len(_SUPERSCRIPTS)]
             for i, note in enumerate(dict.fromkeys(row.note for row in result.rows if row.note))}
    for row in result.rows:
        o, r = row.ours.stats, row.ref.stats
        ref_label = row.ref.label + (f" {marks[row.note]}" if row.note else "")
        cells = [row.case[c] for c in case_cols] + [
            row.ours.label, fmt_stats(o), ref_label, fmt_stats(r),
            ratio_text(o, r, result.higher_is_better),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    for note, mark in marks.items():
        lines.append(f"\n{mark} {note}")
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    """Where the numbers came from: they mean little without it."""
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    info["loadavg_at_start"] = loadavg()
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        info["torch"] = None
    return info


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def markdown_report(result: BenchResult, machine: dict[str, Any], when: str) -> str:
    better = "higher" if result.higher_is_better else "lower"
    parts = [
        f"# {result.title}",
        "",
        result.description.replace("``", "`"),
        "",
        f"Unit: **{result.unit}** ({better} is better). Medians of {_rounds(result)} interleaved "
        "samples per subject, [first–third quartile] in brackets. The last column says how "
        "elastictk compares with the reference: \"×2.00 faster\" means twice the reference's "
        "speed; \"(IQRs overlap)\" means the difference is within this machine's noise.",
        "",
        markdown_table(result),
        "",
        "## Machine",
        "",
        f"{machine['cpu_model']}, {machine['cores']} cores, Python {machine['python']}, "
        f"torch {machine['torch']}, {machine['platform']}; load average (1/5/15 min) "
        f"{machine.get('loadavg_at_start', '?')} at the start and "
        f"{machine.get('loadavg_at_end', '?')} at the end. Finished at {when}.",
    ]
    if result.notes:
        parts += ["", "## Notes", ""] + [f"- {n}" for n in result.notes]
    if result.params:
        parts += ["", "## Parameters", "", f"`{json.dumps(result.params)}`"]
    return "\n".join(parts) + "\n"


def _rounds(result: BenchResult) -> str:
    ns = {row.ours.stats.n for row in result.rows} | {row.ref.stats.n for row in result.rows}
    return "/".join(str(n) for n in sorted(ns)) or "0"


def result_json(result: BenchResult, machine: dict[str, Any], when: str) -> dict[str, Any]:
    def measured(m: Measured) -> dict[str, Any]:
        s = m.stats
        out = {"label": m.label, "median": s.median, "q1": s.q1, "q3": s.q3, "min": s.min,
               "max": s.max, "n": s.n, "samples": m.samples}
        return {**out, "extra": m.extra} if m.extra else out

    return {
        "name": result.name,
        "title": result.title,
        "unit": result.unit,
        "higher_is_better": result.higher_is_better,
        "when": when,
        "machine": machine,
        "params": result.params,
        "notes": result.notes,
        "pids": result.pids,
        "rows": [
            {
                "case": row.case,
                "elastictk": measured(row.ours),
                "reference": measured(row.ref),
                # > 1: elastictk better, whatever the unit's direction.
                "elastictk_advantage": ratio(
                    row.ours.stats, row.ref.stats, result.higher_is_better),
                "summary": ratio_text(row.ours.stats, row.ref.stats, result.higher_is_better),
                **({"note": row.note} if row.note else {}),
            }
            for row in result.rows
        ],
    }


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so an interrupted run never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def now_text() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


def raise_fd_limit(need: int) -> int:
    """Raise this process's soft limit on open files to ``need`` (capped by the hard limit) when
    it is lower; the soft limit in force after. Benchmarks of many nodes hold many sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return int(soft)


def kill_tree(pid: int) -> tuple[float, list[int]]:
    """SIGKILL process ``pid`` and every process under it at once (listed first, so none is
    reparented out of reach); the monotonic time just before the first kill, and the PIDs found
    (for the caller's leak check). A process already gone is no error."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    t = time.monotonic()
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return t, [p.pid for p in procs]

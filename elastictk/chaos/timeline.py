"""``chaos-timeline.png``: what a chaos run did, over time, as a picture worth looking at.

Drawn with matplotlib (the well-kept standard, the optional ``elastictk[plots]`` extra; the
``Agg`` backend, so no display is needed): a lane per rank (a multi-node run: per node), green
while that rank's worker ran, each fault marked where it hit with its kind and target, restarts
of the whole job (a blue line across every lane) told apart from in-place recoveries (a purple
diamond on the replaced rank only), store outages as orange bands, the last step each worker
process reached at the end of its bar (``step N`` where the script numbers its steps, ``N steps
run`` where only its optimizer steps were counted), a legend, and a title naming the run and its seed.

Without matplotlib the report is still written; :func:`write_timeline` says in one line that
the picture was skipped and how to get it. ``python -m elastictk.chaos.timeline REPORT_DIR``
draws it again from a report directory (``record_from_dir``).
"""
from __future__ import annotations

import io
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from .._paths import write_file
from ..metrics.events import read_events
from .multinode import tag_events
from .record import Injection, RunRecord

INSTALL_HINT = "pip install 'elastictk[plots]'"
STOPS = ("worker_failed", "peer_failed", "workers_stopped", "job_finished", "job_failed",
         "timer_expired", "hang_detected")
NODE_STOPS = STOPS + ("membership_changed", "store_lost")
RUNNING, FAULT, RESTART, INPLACE, OUTAGE = "#3caa50", "#dc2828", "#325ad2", "#8e44ad", "#f09a1e"


@dataclass
class Lanes:
    """What the picture shows, in seconds since the run started: pure data, no matplotlib."""

    labels: list[str]
    bars: list[tuple[int, float, float]] = field(default_factory=list)  # (lane, start, end)
    faults: list[tuple[int, float, str]] = field(default_factory=list)  # (lane, t, "kind target")
    restarts: list[tuple[float, Optional[int]]] = field(default_factory=list)  # (t, lane or all)
    inplace: list[tuple[int, float, float]] = field(default_factory=list)  # (lane, failed, formed)
    outages: list[tuple[float, float]] = field(default_factory=list)  # store unreachable
    steps: list[tuple[int, float, str]] = field(default_factory=list)  # (lane, t, last step's label)
    span: float = 0.0


def lanes_of(rec: RunRecord, world: int) -> Lanes:
    """The lanes of ``rec`` (a job of ``world`` ranks): per rank, or per node when multi-node."""
    span = max(1e-6, rec.ended - rec.started)
    if rec.nodes > 1:
        out = _node_lanes(rec, world // rec.nodes)
    else:
        out = _rank_lanes(rec, world)
    out.span = span
    for inj in rec.injections:
        if inj.kind.startswith("store-outage"):
            t = inj.mono - rec.started
            out.outages.append((t, t + float(inj.kind.split(":", 1)[1])))
    return out


def _rank_lanes(rec: RunRecord, world: int) -> Lanes:
    out = Lanes([f"rank {r}" for r in range(world)])
    t0 = rec.started
    since: dict[int, float] = {}
    failed: dict[int, float] = {}
    forming: list[tuple[int, float]] = []  # replaced, waiting for their generation to form
    for e in rec.events:
        t, kind = e.mono - t0, e.kind
        if kind == "workers_started":
            for r in (int(k) for k in (e.fields.get("pids") or {})):
                if r < world:
                    since.setdefault(r, t)
        elif kind == "worker_failed" and e.fields.get("recovery") == "in-place":
            gone = _int(e.fields.get("rank", e.fields.get("local_rank")))
            if gone is not None and gone in since:
                out.bars.append((gone, since.pop(gone), t))
                failed[gone] = t
        elif kind in STOPS:
            for r, s in since.items():
                out.bars.append((r, s, t))
            since.clear()
        if kind == "restart":
            out.restarts.append((t, None))
        elif kind == "inplace_recovery":
            for lr in (e.fields.get("replaced") or {}):
                new = _int(lr)
                if new is not None and new < world:
                    forming.append((new, failed.pop(new, t)))
                    since.setdefault(new, t)
        elif kind in ("inplace_recovered", "inplace_fallback"):
            out.inplace += [(r, f, t) for r, f in forming]
            forming = []
    out.inplace += [(r, f, f) for r, f in forming]
    for r, s in since.items():
        out.bars.append((r, s, rec.ended - t0))
    for inj in rec.injections:
        if inj.kind.startswith("store-outage"):
            continue
        hit = [int(inj.target.split(":")[1])] if inj.target.startswith("rank:") else list(range(world))
        for r in hit:
            if r < world:
                out.faults.append((r, inj.mono - t0, f"{inj.kind} {inj.target}"))
    for p in rec.progress:
        rank, step = _int(p.get("rank")), _int(p.get("step"))
        if p.get("progress") == "exit" and rank is not None and rank < world and step is not None:
            out.steps.append((rank, float(p.get("monotonic", rec.ended)) - t0, step_label(p, step)))
    return out


def _node_lanes(rec: RunRecord, nproc: int) -> Lanes:
    nodes = rec.nodes
    out = Lanes([f"node {n}" for n in range(nodes)])
    t0 = rec.started
    since: dict[int, float] = {}
    marks = [(e.mono, e.fields.get("node"), e.kind, e) for e in rec.events]
    # A killed agent logs nothing more: its workers stop at the kill.
    marks += [(i.mono, int(i.target.split(":")[1]), "killed", None) for i in rec.injections
              if i.kind == "kill-agent"]
    for mono, n, kind, _ in sorted(marks, key=lambda m: m[0]):
        if not isinstance(n, int) or not 0 <= n < nodes:
            continue
        t = mono - t0
        if kind == "workers_started":
            since.setdefault(n, t)
        elif (kind in NODE_STOPS or kind == "killed") and n in since:
            out.bars.append((n, since.pop(n), t))
        if kind == "restart":
            out.restarts.append((t, n))
        elif kind == "inplace_recovery":
            out.inplace.append((n, t, t))
    for n, s in since.items():
        out.bars.append((n, s, rec.ended - t0))
    for inj in rec.injections:
        if inj.kind.startswith("store-outage"):
            continue
        kind, _, idx = inj.target.partition(":")
        n = int(idx) if kind == "node" else int(idx) // max(1, nproc) if kind == "rank" else -1
        if 0 <= n < nodes:
            out.faults.append((n, inj.mono - t0, f"{inj.kind} {inj.target}"))
    for p in rec.progress:
        n, step = _int(p.get("node")), _int(p.get("step"))
        if p.get("progress") == "exit" and n is not None and 0 <= n < nodes and step is not None:
            out.steps.append((n, float(p.get("monotonic", rec.ended)) - t0, step_label(p, step)))
    return out


def step_label(progress: dict[str, Any], step: int) -> str:
    """The label at the end of a worker's bar. A step the script reported (``checkpoint(step)``,
    ``run_elastic``) is the job's own number: ``step N``. The automatic count (optimizer steps)
    starts at 0 in every process, so after a resume it is no step number of the job (a job
    resumed from step 10 that ended at 40 counted 30): it says how many that process ran."""
    return f"{step} steps run" if progress.get("source") == "auto" else f"step {step}"


def _int(v: Any) -> Optional[int]:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def draw(rec: RunRecord, path: Path, world: int, *, title: str = "chaos run",
         seed: Optional[int] = None) -> Path:
    """Write the timeline of ``rec`` to ``path`` (PNG). Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    lanes = lanes_of(rec, world)
    n = len(lanes.labels)
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.55 * n), dpi=110)
    try:
        for lane in range(n):
            ax.barh(lane, lanes.span, left=0, height=0.7, color="#ececec", zorder=0)
        for lane, s, e in lanes.bars:
            ax.barh(lane, max(e - s, 1e-3), left=s, height=0.5, color=RUNNING, zorder=1)
        for s, e in lanes.outages:
            ax.axvspan(s, e, color=OUTAGE, alpha=0.3, zorder=0.5)
        for t, only in lanes.restarts:
            if only is None:
                ax.axvline(t, color=RESTART, lw=1.6, ls="--", zorder=2)
            else:
                ax.plot([t, t], [only - 0.45, only + 0.45], color=RESTART, lw=2, ls="--", zorder=2)
        for lane, failed, formed in lanes.inplace:  # down from the failure until re-formed
            ax.plot([failed, formed], [lane, lane], color=INPLACE, lw=5, solid_capstyle="butt", zorder=3)
            ax.plot([formed], [lane], marker="D", ms=8, color=INPLACE, mec="white", zorder=4)
        for i, (lane, t, text) in enumerate(lanes.faults):
            ax.plot([t], [lane], marker="X", ms=11, color=FAULT, mec="white", zorder=5)
            ax.annotate(text, (t, lane), xytext=(5, 9 + 8 * (i % 2)), textcoords="offset points",
                        fontsize=8, color=FAULT, zorder=6)
        for lane, t, label in lanes.steps:
            ax.annotate(label, (t, lane), xytext=(3, -13), textcoords="offset points",
                        fontsize=7, color="#333333", zorder=6)
        ax.set_yticks(range(n), lanes.labels)
        ax.set_ylim(n - 0.4, -0.8)  # first lane on top, room for the labels above it
        first = min((s for _, s, _ in lanes.bars), default=0.0)
        left = max(0.0, first - 0.08 * (lanes.span - first))  # the launch's start-up is dull
        ax.set_xlim(left, lanes.span + 0.02 * (lanes.span - left))
        ax.set_xlabel("seconds since the launch")
        ax.grid(axis="x", color="#dddddd", lw=0.6)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.set_title(_title(rec, title, seed), fontsize=11, loc="left")
        handles = [Patch(color=RUNNING, label="worker running"),
                   Line2D([], [], marker="X", ls="", color=FAULT, ms=9, label="fault (kind, target)")]
        if lanes.restarts or not lanes.inplace:
            handles.append(Line2D([], [], color=RESTART, ls="--", label="restart (all workers)"))
        if lanes.inplace:
            handles.append(Line2D([], [], marker="D", color=INPLACE, lw=4, ms=7,
                                  label="in-place recovery (down until re-formed)"))
        if lanes.outages:
            handles.append(Patch(color=OUTAGE, alpha=0.3, label="store outage"))
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.14 - 0.25 / n),
                  ncol=len(handles), frameon=False, fontsize=8)
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png")
        write_file(path, png.getvalue())  # renamed into place: a planted symlink is not followed
    finally:
        plt.close(fig)
    return path


def _title(rec: RunRecord, name: str, seed: Optional[int]) -> str:
    where = f"{rec.nodes} nodes" if rec.nodes > 1 else "1 node"
    parts = [f"seed {seed}" if seed is not None else "no seed (a given plan)",
             f"{len(rec.injections)} fault(s)", where,
             f"exit {rec.exit_code}" if rec.exit_code is not None else "stopped"]
    return f"elastictk-chaos: {name}\n" + ", ".join(parts)


def write_timeline(rec: RunRecord, path: Path, world: int, *, title: str = "chaos run",
                   seed: Optional[int] = None) -> str:
    """Draw the timeline if matplotlib is there; the one line to tell the user either way."""
    try:
        draw(rec, path, world, title=title, seed=seed)
    except ImportError as e:
        return f"timeline skipped: {e.name or 'matplotlib'} is not installed ({INSTALL_HINT})"
    return f"timeline in {path}"


def run_name(command: Sequence[str], world: int) -> str:
    """How the title names a run: its script (or program) and its world size."""
    script = next((c for c in command if c.endswith(".py")), command[0] if command else "job")
    return f"{Path(script).name}, {world} rank(s)"


def record_from_dir(report_dir: Path) -> tuple[RunRecord, int, Optional[int]]:
    """A recorded run back from its report directory (``chaos-report.json``, the event log,
    the workers' fault log): the record, the world size, the plan's seed."""
    data = json.loads((report_dir / "chaos-report.json").read_text())
    single = report_dir / "chaos-events.jsonl"
    if single.exists():
        events = read_events(single)
    else:  # several nodes: an event log per agent (incarnation), tagged with its node
        per_node = []
        for log in sorted(report_dir.glob("chaos-node*-events.jsonl")):
            m = re.match(r"chaos-node(\d+)", log.name)
            if m:
                per_node.append((int(m.group(1)), read_events(log)))
        events = tag_events(per_node)
    injections = [Injection(**{k: v for k, v in d.items() if k in Injection.__dataclass_fields__})
                  for d in data.get("injections", [])]
    progress = []
    faults_log = report_dir / "chaos-faults.jsonl"
    if faults_log.exists():
        for line in faults_log.read_text().splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if isinstance(d, dict) and "progress" in d:
                progress.append(d)
    totals = data.get("totals", {})
    # The launch and the end are not recorded as such: the last thing logged is about the end
    # (job_finished, a worker's exit), and the run took wall_s from its launch.
    monos = [e.mono for e in events] + [i.mono for i in injections] + \
        [float(p["monotonic"]) for p in progress if isinstance(p.get("monotonic"), (int, float))]
    ended = max(monos) if monos else 0.0
    started = min(monos + [ended - float(totals.get("wall_s") or 0.0)]) if monos else 0.0
    by_fault = {i.fault: i.mono for i in injections}
    for row in data.get("faults", []):  # exact: a fault's injection time is counted from the launch
        if isinstance(row.get("injected_at"), (int, float)) and row.get("index") in by_fault:
            started = by_fault[row["index"]] - float(row["injected_at"])
            ended = max(ended, started + float(totals.get("wall_s") or 0.0))
            break
    rec = RunRecord(argv=list(data.get("command", [])), started=started, ended=ended,
                    exit_code=totals.get("exit_code"), injections=injections, progress=progress,
                    events=events, nodes=int(totals.get("nodes") or 1))
    plan = data.get("plan") or {}
    world = int((plan.get("knobs") or {}).get("world_size") or 0)
    if not world:
        world = max([len(e.fields.get("pids") or {}) for e in events if e.kind == "workers_started"]
                    + [1]) * rec.nodes
    seed = plan.get("seed")
    return rec, world, int(seed) if isinstance(seed, int) else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or not (Path(args[0]) / "chaos-report.json").is_file():
        print("usage: python -m elastictk.chaos.timeline REPORT_DIR (a directory elastictk-chaos "
              "wrote, with chaos-report.json)", file=sys.stderr)
        return 2
    where = Path(args[0])
    try:
        rec, world, seed = record_from_dir(where)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        print(f"python -m elastictk.chaos.timeline: {where} is not a readable report directory: {e}",
              file=sys.stderr)
        return 2
    print(write_timeline(rec, where / "chaos-timeline.png", world, title=run_name(rec.argv, world), seed=seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What one join costs, and the verdicts judged from it: pure functions of the measured numbers.

Wall time at a thousand simulated nodes on two cores measures the harness as much as the
protocol; what a node sends and receives to join does not drift with load. So the growth
verdicts of the rendezvous rest on per-join store calls, bytes and wake-ups (and, on etcd,
requests on the wire), counted on each node's own connection (``_rdzv_scale_store.Meter``):

- the **median** node is the typical joiner; the round's closer, which reads the O(N) whole
  once by design, shows in the **max** column, never in the verdict;
- a verdict needs every one of :data:`SIZES` measured on the store, and fails when a size's
  median is past :data:`MAX_CALLS` calls or :data:`MAX_BYTES` bytes, or when the median bytes
  grow by more than :data:`FLAT` from the smallest size to the largest (not flat in N).

Time verdicts are refused, not judged, when the machine was busier than its cores at the start
of the run (:func:`load_refusal`): the calls and bytes are judged all the same.
"""
from __future__ import annotations

import os
import statistics
from typing import Any, Sequence

from ._rdzv_scale_fit import Verdict

SIZES = (64, 256, 1024)
MAX_CALLS = 6
MAX_BYTES = 1024
FLAT = 1.5  # median bytes per join at the largest size over the smallest
FIELDS = ("calls", "bytes", "waits", "wakeups", "etcd_requests")


def per_join(costs: Sequence[dict[str, int] | None]) -> dict[str, dict[str, float]] | None:
    """Median, mean and max over the nodes of each join's cost (bytes: in + out)."""
    rows = [c for c in costs if c]
    if not rows:
        return None
    out: dict[str, dict[str, float]] = {}
    for f in FIELDS:
        vals = [float(c["bytes_in"] + c["bytes_out"]) if f == "bytes" else float(c[f]) for c in rows if
                (f == "bytes" and "bytes_in" in c) or f in c]
        if vals:
            out[f] = {"median": statistics.median(vals), "mean": round(statistics.fmean(vals), 2),
                      "max": max(vals)}
    return out


def join_verdicts(cases: list[dict[str, Any]], label: str, backend: str, phase: str = "form") -> Verdict:
    """At most MAX_CALLS calls and MAX_BYTES bytes per join (median node) at every size of
    SIZES on ``backend``, flat in N; ``phase``: ``form`` (a fresh job) or ``reform``."""
    what = "forming" if phase == "form" else "re-forming after a lost node"
    target = (f"{label}, {what}: per join at most {MAX_CALLS} store calls and {MAX_BYTES:,} bytes (median "
              f"node) at {'/'.join(f'{n:,}' for n in SIZES)} nodes, flat in N (bytes x{FLAT:g} at most)")
    got = {c["nodes"]: c.get(f"{phase}_join") for c in cases if c.get("backend") == backend}
    missing = [n for n in SIZES if not got.get(n)]
    if missing:
        return Verdict(target, f"not measured at {', '.join(f'{n:,}' for n in missing)} nodes", None)
    calls = {n: got[n]["calls"]["median"] for n in SIZES}  # type: ignore[index]
    size = {n: got[n]["bytes"]["median"] for n in SIZES}  # type: ignore[index]
    measured = "; ".join(f"{n:,}: {calls[n]:g} calls, {size[n]:,.0f} B" for n in SIZES)
    growth = size[SIZES[-1]] / max(size[SIZES[0]], 1.0)
    ok = all(calls[n] <= MAX_CALLS and size[n] <= MAX_BYTES for n in SIZES) and growth <= FLAT
    return Verdict(target, f"{measured} (bytes x{growth:.2f} from {SIZES[0]} to {SIZES[-1]:,})", ok)


def load_refusal(load: Sequence[float] | None, cores: int | None = None) -> str | None:
    """Why the run's times cannot be judged (the 1-minute load average past the cores), or None."""
    cores = cores or os.cpu_count() or 1
    if load is None or load[0] <= cores:
        return None
    return (f"refused: the load average was {load[0]:.1f} at the start, past this machine's {cores} "
            "cores, so the times would measure the other load; calls and bytes per join are judged")


def refused(v: Verdict, why: str | None) -> Verdict:
    """``v`` unjudged (UNKNOWN, saying why) when the run's times were refused."""
    return v if why is None else Verdict(v.target, f"{why} (measured {v.measured})", None)


def reform_within(cases: list[dict[str, Any]], nodes: int, limit: float) -> Verdict:
    """After the lost node is noticed (its first peer's watch fired), every survivor is in a
    new round within ``limit`` seconds, on TCPStore at ``nodes``."""
    target = f"TCPStore, {nodes:,} nodes: every survivor re-formed < {limit:g} s after the loss is noticed"
    c = next((c for c in cases if c.get("backend") == "tcp" and c.get("nodes") == nodes), None)
    if c is None or c.get("reformed_s") is None or c.get("lost_noticed_s") is None:
        return Verdict(target, f"no {nodes:,}-node re-form was measured"
                       + (f" ({c['reform_note']})" if c and c.get("reform_note") else ""), None)
    took = c["reformed_s"] - c["lost_noticed_s"]
    return Verdict(target, f"{took:.2f} s", took < limit)


def forms_and_reforms(cases: list[dict[str, Any]], backend: str, label: str, nodes: int) -> Verdict:
    """The round of ``nodes`` forms and re-forms after a lost node (times reported, not judged)."""
    target = f"{label}: {nodes:,} nodes form and re-form after a lost node"
    c = next((c for c in cases if c.get("backend") == backend and c.get("nodes") == nodes), None)
    if c is None:
        return Verdict(target, f"no {nodes:,}-node case was run", None)
    if "error" in c:
        return Verdict(target, f"failed: {c['error']}", False)
    if c.get("reformed_s") is None:
        note = c.get("reform_note") or "the re-form was not measured"
        return Verdict(target, f"formed in {c['form_s']:.2f} s; {note}", None if "not measured" in note else False)
    return Verdict(target, f"formed in {c['form_s']:.2f} s, re-formed {c['reformed_s']:.2f} s after the loss", True)


def markdown_rows(cases: list[dict[str, Any]], names: dict[str, str]) -> list[str]:
    """The per-join table: median / max over the nodes, at formation and at the re-form."""
    lines = ["| store | nodes | phase | calls (median / max) | bytes (median / max) | waits (median / max) "
             "| wake-ups (median / max) | etcd requests (median / max) |", "|" + "---|" * 8]
    for c in cases:
        for phase in ("form", "reform"):
            j = c.get(f"{phase}_join")
            if not j:
                continue

            def cell(f: str) -> str:
                return "—" if f not in j else f"{j[f]['median']:,.0f} / {j[f]['max']:,.0f}"
            lines.append(f"| {names[c['backend']]} | {c['nodes']:,} | {phase} | {cell('calls')} | {cell('bytes')} "
                         f"| {cell('waits')} | {cell('wakeups')} | {cell('etcd_requests')} |")
    return lines

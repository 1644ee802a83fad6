"""torch's c10d rendezvous beside elastictk's: the comparison, as pure functions of the measured
cases of ``python -m bench rendezvous --scale`` (``bench/_rdzv_scale_c10d.py`` measures them).

At every size torch's c10d rendezvous was run, its formation time and per-join calls and bytes
(median node) stand beside elastictk's on TCPStore (the same server) with their ratios; a c10d
round that did not form within its cap counts at the cap, and what its unfinished joins had
sent is a lower bound (shown with ≥); a size where c10d failed is shown failed and not judged.
"""
from __future__ import annotations

from typing import Any

from ._rdzv_scale_c10d import LABEL
from ._rdzv_scale_fit import Verdict


def _pair(cases: list[dict[str, Any]], n: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    pick = {(c.get("backend"), c.get("nodes")): c for c in cases}
    return pick.get(("tcp", n)), pick.get(("c10d", n))


def _median(c: dict[str, Any], field: str) -> float | None:
    j = c.get("form_join") if c.get("form_s") is not None else c.get("form_join_unfinished")
    return None if not j or field not in j else float(j[field]["median"])


def _x(theirs: float, ours: float, at_least: bool) -> str:
    if ours <= 0:
        return "—"
    r = theirs / ours
    return f"{'≥ ' if at_least else ''}×{r:,.0f}" if r >= 100 else f"{'≥ ' if at_least else ''}×{r:.3g}"


def compare(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per size torch's c10d rendezvous was run at: its formation time and per-join
    calls and bytes (median node) beside elastictk's on TCPStore (the same server), and the
    ratios where both were measured; ``at_least`` where c10d did not form within its cap (its
    time is then the cap, its bytes those its unfinished joins had sent: lower bounds)."""
    rows = []
    for n in sorted({int(c["nodes"]) for c in cases if c.get("backend") == "c10d"}):
        ours, theirs = _pair(cases, n)
        assert theirs is not None
        row: dict[str, Any] = {"nodes": n, "etk_form_s": None, "c10d_form_s": theirs.get("form_s"),
                               "c10d_state": "failed" if "error" in theirs else
                               ("formed" if theirs.get("form_s") is not None else "not formed"),
                               "cap_s": theirs.get("form_cap_s"), "at_least": theirs.get("form_s") is None,
                               "c10d_calls": _median(theirs, "calls"), "c10d_bytes": _median(theirs, "bytes")}
        if ours is not None and "error" not in ours and ours.get("form_s") is not None:
            row.update(etk_form_s=ours["form_s"], etk_calls=_median(ours, "calls"), etk_bytes=_median(ours, "bytes"))
        rows.append(row)
    return rows


def beside_verdict(cases: list[dict[str, Any]]) -> Verdict:
    """elastictk on TCPStore forms sooner and moves fewer bytes per join (median node) than
    torch's c10d rendezvous at every size both were measured; a c10d round that did not form
    within its cap counts at the cap (elastictk must have formed sooner than that)."""
    target = ("elastictk on TCPStore forms sooner than torch's c10d rendezvous and moves fewer "
              "bytes per join (median node), at every size both were run")
    judged, parts, ok = 0, [], True
    for r in compare(cases):
        n = f"{r['nodes']:,}"
        if r["c10d_state"] == "failed" or r["etk_form_s"] is None:
            parts.append(f"{n}: not compared ({'c10d failed' if r['c10d_state'] == 'failed' else 'no elastictk round'})")
            continue
        t_theirs = r["c10d_form_s"] if r["c10d_form_s"] is not None else r["cap_s"]
        b_ours, b_theirs = r.get("etk_bytes"), r.get("c10d_bytes")
        judged += 1
        sooner = r["etk_form_s"] < t_theirs
        fewer = b_ours is not None and b_theirs is not None and b_ours < b_theirs
        ok = ok and sooner and fewer
        parts.append(f"{n}: {r['etk_form_s']:.3g} s vs {'≥ ' if r['at_least'] else ''}{t_theirs:.3g} s, "
                     f"{b_ours or 0:,.0f} B vs {'≥ ' if r['at_least'] else ''}{b_theirs or 0:,.0f} B")
    if not judged:
        return Verdict(target, "; ".join(parts) or "torch's c10d rendezvous was not run", None)
    return Verdict(target, "; ".join(parts), ok)


def markdown(cases: list[dict[str, Any]]) -> list[str]:
    """The side-by-side table (and the unfinished joins' costs where c10d did not form)."""
    rows = compare(cases)
    if not rows:
        return []
    lines = ["## elastictk beside torch's c10d rendezvous (the same TCPStore server)", "",
             "| nodes | elastictk formed | c10d formed | c10d / elastictk | per join, elastictk: calls, bytes "
             "| per join, c10d: calls, bytes | bytes c10d / elastictk |", "|" + "---|" * 7]
    for r in rows:
        ours = "—" if r["etk_form_s"] is None else f"{r['etk_form_s']:.3g} s"
        if r["c10d_state"] == "failed":
            theirs, ratio = "failed (see above)", "—"
        elif r["c10d_state"] == "not formed":
            theirs = f"did not form within {r['cap_s']:g} s"
            ratio = "—" if r["etk_form_s"] is None else _x(r["cap_s"], r["etk_form_s"], True)
        else:
            theirs = f"{r['c10d_form_s']:.3g} s"
            ratio = "—" if r["etk_form_s"] is None else _x(r["c10d_form_s"], r["etk_form_s"], False)

        def cost(calls: float | None, nbytes: float | None, lower: bool) -> str:
            return "—" if calls is None or nbytes is None else f"{'≥ ' if lower else ''}{calls:g}, {nbytes:,.0f} B"
        bx = "—"
        if r.get("etk_bytes") and r["c10d_bytes"] is not None:
            bx = _x(r["c10d_bytes"], r["etk_bytes"], r["at_least"])
        lines.append(f"| {r['nodes']:,} | {ours} | {theirs} | {ratio} | {cost(r.get('etk_calls'), r.get('etk_bytes'), False)} "
                     f"| {cost(r['c10d_calls'], r['c10d_bytes'], r['at_least'])} | {bx} |")
    lines += ["", "Where c10d did not form, its time is at least the cap and its per-join figures are what "
              "its unfinished joins had sent by then (median node): lower bounds (≥)."]
    return lines


def unfinished_rows(cases: list[dict[str, Any]]) -> list[str]:
    """Rows for the per-join table: what a c10d round's unfinished joins had sent at its cap."""
    out = []
    for c in cases:
        j = c.get("form_join_unfinished")
        if j:
            def cell(f: str) -> str:
                return "—" if f not in j else f"≥ {j[f]['median']:,.0f} / {j[f]['max']:,.0f}"
            out.append(f"| {LABEL} | {c['nodes']:,} | form, unfinished at the {c['form_cap_s']:g} s cap "
                       f"| {cell('calls')} | {cell('bytes')} | {cell('waits')} | {cell('wakeups')} | — |")
    return out

"""torch's c10d rendezvous beside elastictk's in ``python -m bench rendezvous --scale``: the
comparison is computed from the measured cases, a c10d round that did not form within its cap
is shown as such (with lower bounds, never as a pass for torch), and one that failed is shown
as failed, never dropped. The end-to-end run is the quick run in test_bench_rdzv_scale.py."""
from __future__ import annotations

from typing import Any

import pytest

from bench import _rdzv_scale_beside as beside
from bench._rdzv_scale import QUICK, choose_plan, markdown, verdicts


def _join(calls: float, nbytes: float) -> dict[str, dict[str, float]]:
    return {"calls": {"median": calls, "mean": calls, "max": calls * 3},
            "bytes": {"median": nbytes, "mean": nbytes, "max": nbytes * 9}}


def _ours(n: int, form_s: float, nbytes: float = 840.0) -> dict[str, Any]:
    return {"backend": "tcp", "nodes": n, "form_s": form_s, "form_first_rank_s": form_s / 2,
            "form_join": _join(5, nbytes)}


def _theirs(n: int, form_s: float | None, nbytes: float, cap: float = 60.0) -> dict[str, Any]:
    c: dict[str, Any] = {"backend": "c10d", "nodes": n, "form_cap_s": cap, "form_s": form_s,
                         "form_first_rank_s": form_s, "ranked": n if form_s is not None else 3}
    if form_s is None:
        c["form_note"] = f"did not form within {cap:g} s (3 of {n} nodes had a rank)"
        c["form_join_unfinished"] = _join(70, nbytes)
    else:
        c["form_join"] = _join(5, nbytes)
    return c


def _word(cases: list[dict[str, Any]]) -> bool | None:
    return beside.beside_verdict(cases).passed


def test_elastictk_sooner_and_lighter_passes_and_either_side_failing_fails() -> None:
    both = [_ours(8, 0.01), _ours(64, 0.1), _theirs(8, 1.3, 4_000), _theirs(64, 1.4, 20_000)]
    assert _word(both) is True
    slower = [_ours(8, 0.01), _ours(64, 2.0), _theirs(8, 1.3, 4_000), _theirs(64, 1.4, 20_000)]
    assert _word(slower) is False  # c10d formed sooner at 64 nodes
    heavier = [_ours(8, 0.01, nbytes=5_000), _theirs(8, 1.3, 4_000)]
    assert _word(heavier) is False  # c10d's median join moved fewer bytes
    rows = beside.compare(both)
    assert [(r["nodes"], r["c10d_state"]) for r in rows] == [(8, "formed"), (64, "formed")]
    assert "| 64 | 0.1 s | 1.4 s | ×14 | 5, 840 B | 5, 20,000 B | ×23.8 |" in beside.markdown(both)


def test_a_round_that_did_not_form_is_a_lower_bound_judged_at_its_cap() -> None:
    cases = [_ours(1024, 1.5), _theirs(1024, None, 2_500_000)]
    assert _word(cases) is True
    text = "\n".join(beside.markdown(cases))
    assert "did not form within 60 s" in text and "≥ ×40" in text and "≥ 70, 2,500,000 B" in text
    assert any("unfinished at the 60 s cap" in r and "≥ 70 / 210" in r for r in beside.unfinished_rows(cases))
    assert _word([_ours(1024, 75.0), _theirs(1024, None, 2_500_000)]) is False  # elastictk past the cap


def test_a_failed_or_unpaired_c10d_size_is_shown_and_never_a_pass() -> None:
    failed = {"backend": "c10d", "nodes": 64, "form_cap_s": 60.0, "error": "torch c10d with 64 nodes: boom"}
    v = beside.beside_verdict([_ours(64, 0.1), failed])
    assert v.passed is None and "c10d failed" in v.measured
    assert beside.beside_verdict([_theirs(256, 16.6, 1_600_000)]).passed is None  # no elastictk round at 256
    assert beside.beside_verdict([_ours(64, 0.1)]).passed is None  # c10d not run
    # the whole report: the failed c10d size has its row, the not-formed one its note
    result = {"machine": {"cpu_model": "x", "cores": 2, "python": "3", "torch": "2", "platform": "p"},
              "cases": [_ours(64, 0.1), failed, _theirs(1024, None, 2_500_000)], "notes": [], "when": "now",
              "params": {}, "refusal": None}
    result["verdicts"] = [v.to_json() for v in verdicts(result["cases"])]
    text = markdown(result)
    assert "| torch c10d | 64 | failed: torch c10d with 64 nodes: boom |" in text
    assert "| torch c10d | 1,024 | did not form within 60 s (3 of 1024 nodes had a rank) |" in text
    assert "failed (see above)" in text


def test_c10d_is_chosen_by_stores_and_runs_after_elastictk() -> None:
    plan = choose_plan(QUICK, "c10d,tcp", "8,64", "all")
    assert list(plan.sizes) == ["tcp", "c10d"] and plan.sizes["c10d"] == (8, 64)
    assert list(choose_plan(QUICK, None, None, "all").sizes) == ["tcp", "etcd", "c10d"]
    with pytest.raises(ValueError, match="tcp, etcd and c10d"):
        choose_plan(QUICK, "c10", None, "all")

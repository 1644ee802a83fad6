"""``python -m bench rendezvous --scale``: its verdicts can fail, and its quick mode runs.

The verdicts are pure functions of the measured numbers (``bench/_rdzv_scale_fit.py``), so they
are attacked at unit level with planted curves: a quadratic load, one that turns quadratic
only at the top of the range, a round that formed too slowly. One end-to-end run of
``--quick`` (TCPStore and etcd, simulated nodes in forked workers) checks that the numbers it
reports are the protocol's: a heartbeat per interval per node, a lost node noticed no sooner
than its heartbeat timeout allows, every survivor in a new round without it; and that torch's
c10d rendezvous ran beside it (8 nodes), formed, was counted and compared.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from typing import Callable

from bench._rdzv_scale import QUICK, choose_plan, kept_up, verdicts
from bench._rdzv_scale_join import SIZES as JOIN_SIZES
from bench._rdzv_scale_join import join_verdicts, load_refusal, per_join, reform_within
from bench._rdzv_scale_fit import MAX_EXPONENT, exponent, formed_within, linear_growth

ROOT = Path(__file__).resolve().parent.parent
SIZES = [8, 32, 128, 512, 1024]


def test_the_exponent_of_a_power_law_is_its_power() -> None:
    assert exponent(SIZES, [3.0 * n for n in SIZES]) == pytest.approx(1.0)
    assert exponent(SIZES, [0.5 * n * n for n in SIZES]) == pytest.approx(2.0)
    for bad in ([1.0], [0.0, 1.0], [float("nan"), 1.0]):
        with pytest.raises(ValueError):
            exponent(list(range(1, len(bad) + 1)), bad)
    with pytest.raises(ValueError):
        exponent([8, 8], [1.0, 2.0])


def test_a_linear_load_passes_and_a_quadratic_one_fails() -> None:
    linear = linear_growth("calls/s", SIZES, [7.3 * n + 20 for n in SIZES])
    assert linear.passed is True and "exponent 0.98" in linear.measured
    quadratic = linear_growth("calls/s", SIZES, [7.3 * n + 0.01 * n * n for n in SIZES])
    assert quadratic.passed is False and quadratic.word == "FAIL"
    # Linear up to 512 nodes, then four times the load for twice the nodes: the top pair flags it.
    late = [7.3 * n for n in SIZES[:-1]] + [4 * 7.3 * 512]
    assert exponent(SIZES[1:], late[1:]) <= MAX_EXPONENT  # the whole-range fit alone would miss it
    assert linear_growth("calls/s", SIZES, late).passed is False


def test_too_few_sizes_is_unknown_never_a_pass() -> None:
    v = linear_growth("calls/s", [8, 32], [58.0, 230.0])  # one size from 32 nodes on
    assert v.passed is None and v.word == "UNKNOWN"
    assert linear_growth("calls/s", SIZES, [None] * len(SIZES)).passed is None


def test_the_formation_target() -> None:
    assert formed_within("TCPStore", 1024, 1.4, 2.0).passed is True
    assert formed_within("TCPStore", 1024, 2.0, 2.0).passed is False
    assert formed_within("TCPStore", 1024, None, 2.0).passed is None
    planted = [{"backend": "tcp", "nodes": n, "form_first_rank_s": 0.001 * n, "form_s": 0.002 * n,
                "steady_calls_per_s": 7.0 * n, "steady_server_cpu": 0.0002 * n * n} for n in SIZES]
    formed = [v.passed for v in verdicts(planted) if "round" in v.target]
    assert formed == [True, False]  # closed in the store after 1.024 s; every node after 2.048 s
    assert [v.passed for v in verdicts(planted) if "TCPStore" in v.target and "grows" in v.target] == [True, False]


def test_a_window_whose_nodes_lagged_is_left_out_of_the_fit() -> None:
    """A quadratic curve hidden by clients that could not keep up is unknown, not a pass."""
    cases = [{"backend": "tcp", "nodes": n, "steady_calls_per_s": 0.01 * n * n, "steady_server_cpu": 0.001 * n,
              "steady_calls_per_node_s": {"add": 1.0}} for n in SIZES]
    assert [v.passed for v in verdicts(cases) if "TCPStore: store calls" in v.target] == [False]
    for c in cases[2:]:
        c["steady_calls_per_node_s"] = {"add": 0.5}  # half the heartbeats: the nodes set the pace
    assert [v.passed for v in verdicts(cases) if "TCPStore: store calls" in v.target] == [None]


def test_etcd_nodes_keep_up_by_their_lease_renewals_not_counter_bumps() -> None:
    """On etcd liveness is a lease renewed every third of the heartbeat timeout: no adds."""
    case = {"backend": "etcd", "nodes": 64, "heartbeat_timeout": 10.0,
            "steady_calls_per_node_s": {"keepalive": 1 / 3, "add": 0.0}}
    assert kept_up(case, 1.0)
    case["steady_calls_per_node_s"] = {"keepalive": 0.2}  # 60% of the renewals
    assert not kept_up(case, 1.0)
    assert not kept_up({"backend": "tcp", "steady_calls_per_node_s": {"keepalive": 1.0}}, 1.0)


def _cost(calls: int, nbytes: int) -> dict[str, int]:
    return {"calls": calls, "bytes_in": nbytes - 100, "bytes_out": 100, "waits": 1, "wakeups": 1}


def test_per_join_costs_are_judged_on_the_median_node_and_must_stay_flat() -> None:
    j = per_join([_cost(5, 600)] * 9 + [_cost(40, 90_000)] + [None])  # the closer reads the whole once
    assert j is not None and j["calls"]["median"] == 5 and j["calls"]["max"] == 40 and j["bytes"]["median"] == 600
    assert per_join([None]) is None

    def cases(calls: int, nbytes: "Callable[[int], int]") -> list[dict[str, object]]:
        return [{"backend": "tcp", "nodes": n, "form_join": per_join([_cost(calls, nbytes(n))] * 5)} for n in JOIN_SIZES]

    assert join_verdicts(cases(5, lambda n: 600), "TCPStore", "tcp").passed is True
    assert join_verdicts(cases(7, lambda n: 600), "TCPStore", "tcp").passed is False  # too many calls
    assert join_verdicts(cases(5, lambda n: 1100), "TCPStore", "tcp").passed is False  # too many bytes
    assert join_verdicts(cases(5, lambda n: 300 + n // 2), "TCPStore", "tcp").passed is False  # grows with N
    grown = join_verdicts(cases(12, lambda n: 72 * n + 560), "TCPStore", "tcp")  # today's protocol
    assert grown.passed is False and "1,024: 12 calls, 74,288 B" in grown.measured
    assert join_verdicts(cases(5, lambda n: 600)[:2], "TCPStore", "tcp").passed is None  # 1,024 not run
    assert join_verdicts(cases(5, lambda n: 600), "etcd", "etcd").passed is None


def test_a_busy_machine_refuses_the_times_but_not_the_calls() -> None:
    assert load_refusal([1.9, 1.0, 1.0], cores=2) is None and load_refusal(None, cores=2) is None
    why = load_refusal([11.7, 5.0, 3.0], cores=2)
    assert why is not None and "11.7" in why and "2 cores" in why
    fast = {"backend": "tcp", "nodes": 1024, "form_s": 1.0, "form_first_rank_s": 0.5, "lost_noticed_s": 10.0,
            "reformed_s": 11.0, "form_join": per_join([_cost(5, 600)])}
    timed = [v for v in verdicts([fast], refusal=why) if "< " in v.target]
    assert timed and all(v.passed is None and "refused" in v.measured for v in timed)
    assert all(v.passed is True for v in verdicts([fast]) if "< " in v.target)
    slow = {**fast, "reformed_s": 13.5}  # 3.5 s after the loss was noticed
    assert reform_within([slow], 1024, 3.0).passed is False


def test_bad_stores_and_sizes_are_refused_in_one_line() -> None:
    plan = choose_plan(QUICK, "etcd", "64,256", "form")
    assert plan.sizes == {"etcd": (64, 256)} and plan.phases == ("form",)
    for stores, sizes in (("redis", None), ("", None), (None, "x"), (None, "1"), (None, "")):
        with pytest.raises(ValueError, match="--s"):
            choose_plan(QUICK, stores, sizes if sizes != "" else ",", "all")


@pytest.mark.skipif(shutil.which("etcd") is None and not Path("/usr/bin/etcd").exists(), reason="no etcd")
def test_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    r = subprocess.run([sys.executable, "-m", "bench", "rendezvous", "--scale", "--quick", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    cases = {(c["backend"], c["nodes"]): c for c in result["cases"]}
    assert set(cases) == {(b, n) for b, sizes in QUICK.sizes.items() for n in sizes}
    # torch's own c10d rendezvous, beside elastictk's on the same kind of server: formation only
    theirs = cases.pop(("c10d", 8))
    assert "error" not in theirs and theirs["ranked"] == 8, theirs
    assert 0 < theirs["form_first_rank_s"] <= theirs["form_s"] < QUICK.c10d_cap
    # its one state blob lists every node: a join moves more than elastictk's whole join does
    assert theirs["form_join"]["calls"]["median"] >= 2 and theirs["form_join"]["bytes"]["median"] > 8 * 100
    beside = [v for v in result["verdicts"] if "c10d" in v["target"]]
    assert len(beside) == 1 and beside[0]["passed"] is not None and beside[0]["measured"].startswith("8: ")
    assert "## elastictk beside torch's c10d rendezvous" in r.stdout and "| torch c10d | 8 | form |" in r.stdout
    for (backend, n), c in cases.items():
        assert "error" not in c, c
        assert 0 < c["form_first_rank_s"] <= c["form_s"] < QUICK.form_cap
        per = c["steady_calls_per_node_s"]
        # at most one heartbeat per interval per node; fewer when a loaded host delays the beating
        # thread (etcd beside CPU hogs: 1.33/s against 2/s): a count, not a pace
        if backend == "etcd":  # liveness by lease: a keepalive per renewal, never a counter
            renew = QUICK.heartbeat_interval * max(1, int(QUICK.heartbeat_timeout / 3 / QUICK.heartbeat_interval))
            assert per.get("add", 0) == 0 and 0 < per["keepalive"] <= 1.25 / renew, (backend, n, per)
            # the successors and the failure key are watched (a stream each, opened once), not
            # read every interval: at most one opening read per node in the window (a loaded
            # host still opening its watches as the window begins), where polling is one a turn
            opened = per.get("leased_get", 0) * c["steady_window_s"]
            assert opened <= 1.01 < c["steady_window_s"] / QUICK.heartbeat_interval, (backend, n, per)
        else:
            assert 0 < per["add"] <= 1.25 / QUICK.heartbeat_interval, (backend, n, per)
            # at most one successors' read per interval (no polling storm); fewer when a loaded
            # host stretches the watch's turns: a count, not a pace
            assert 0 < per["multi_get"] <= 1.3 / QUICK.heartbeat_interval, (backend, n, per)
        # a silent node is lost no sooner than its timeout (less the beat it may have just sent)
        assert QUICK.heartbeat_timeout - QUICK.heartbeat_interval <= c["lost_noticed_s"] <= c["reformed_s"]
        assert c["reformed_s"] < QUICK.heartbeat_timeout + QUICK.reform_cap
        assert c["steady_server_cpu"] >= 0 and c["server_rss_mib"] > 0
        for phase in ("form_join", "reform_join"):  # each node's own calls, bytes and wake-ups
            j = c[phase]
            assert j["calls"]["median"] >= 3 and j["bytes"]["median"] > 100 and j["wakeups"]["max"] >= 1
            assert ("etcd_requests" in j) == (backend == "etcd")
    # Two sizes from 32 nodes on are needed for a growth verdict, and 64/256/1,024 for the
    # per-join ones: the quick run has fewer.
    assert {v["verdict"] for v in result["verdicts"] if "c10d" not in v["target"]} == {"UNKNOWN"}
    assert "| TCPStore | 8 | form |" in r.stdout
    assert "| TCPStore | 32 |" in r.stdout


def test_a_round_is_judged_by_a_sample_of_member_lists_read_back() -> None:
    """Every node's rank and round, and the member list a sample of nodes read back: a sample
    that disagrees, or no sample at all, is no verdict."""
    from bench._rdzv_scale import ScaleError, _check_round
    from bench._rdzv_scale_fleet import NodeReport, _digest

    ids = [f"sim{i:04d}" for i in range(4)]

    def reports(members: dict[int, str]) -> list[NodeReport]:
        return [NodeReport(i, n, 3, i, 4, members.get(i), 1.0, None, None) for i, n in enumerate(ids)]

    good = _digest(ids)
    assert _check_round(reports({0: good, 2: good}), 4, "x") == 3
    for members in ({}, {0: good, 2: _digest(ids[:3])}):
        with pytest.raises(ScaleError, match="disagree on the member list"):
            _check_round(reports(members), 4, "x")

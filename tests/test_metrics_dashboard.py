"""The Grafana dashboard and the metrics docs name only metrics that exist, and all of them."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest
from prometheus_client import CollectorRegistry

from elastictk.metrics import AgentMetrics, WorkerStepsBlock
from elastictk.testing import PrometheusNotInstalled, PrometheusServer
from elastictk.metrics import worker as worker_mod
from elastictk.metrics.recovery import NAMES as PHASES

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "contrib" / "grafana-dashboard.json"
DOCS = ROOT / "docs" / "metrics.md"
NAME = re.compile(r"\belastictk_[a-z_]+\b")
SUFFIXES = ("_bucket", "_sum", "_count", "_created")


def exported() -> tuple[set[str], set[str]]:
    """(family names as exposed, every sample name) of an agent that has seen every kind of event."""
    ticks = iter(range(10_000))
    with WorkerStepsBlock(1) as block:
        reg = CollectorRegistry()
        m = AgentMetrics(reg, job="j", max_restarts=2, local_world_size=1, steps=block,
                         clock=lambda: float(next(ticks)))
        m("round_joined", round=0, rank=0, world=1)
        m("workers_started", attempt=0, restart_count=0, pids={0: 1})
        writer = worker_mod._Slot(block.path, 0)
        writer.record(0.1)
        writer.checkpoint()
        m("timer_expired", local_rank=0, scope="step")
        m("worker_failed", rank=0, local_rank=0, exit="SIGKILL")
        m("membership_changed", reason="round 1 opened: 1 node(s) arrived")
        m("round_joined", round=1, rank=0, world=2)
        m("restart", restart_count=1, delay_s=0)
        m("workers_started", attempt=1, restart_count=1, pids={0: 2})
        m("recovery", path="restart-all", restart_count=1, total_ms=60.0, steps_redone=3,
          phases_ms={phase: 10.0 for phase in PHASES})
        families = list(reg.collect())
        del writer
    family_names = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    samples = {s.name for f in families for s in f.samples}
    return family_names, samples


def exprs(dash: dict[str, Any]) -> Iterator[str]:
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            yield target["expr"]
    for ann in dash["annotations"]["list"]:
        if "expr" in ann:
            yield ann["expr"]


def test_dashboard_is_a_grafana_dashboard() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        assert p["type"] in ("stat", "timeseries") and p["targets"], p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "run_id"} <= variables
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for must in ("world size", "restarts", "goodput", "recovery time", "recovery phases", "steps redone"):
        assert must in titles


def test_recovery_phases_panel_stacks_the_median_of_each_phase() -> None:
    """The phase panel splits by ``phase`` and stacks, so its height is a typical recovery; every
    phase it can show is one the agent observes, and the redone-steps panel reads the counter."""
    dash = json.loads(DASHBOARD.read_text())
    panels = {p["title"].lower(): p for p in dash["panels"]}
    [phases] = [p for t, p in panels.items() if "recovery phases" in t]
    [expr] = [t["expr"] for t in phases["targets"]]
    assert "elastictk_recovery_phase_seconds_bucket" in expr and "histogram_quantile(0.5," in expr
    assert re.search(r"sum by \([^)]*\bphase\b[^)]*\ble\b", expr), expr
    assert "{{phase}}" in phases["targets"][0]["legendFormat"]
    assert phases["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    [redone] = [p for t, p in panels.items() if "steps redone" in t]
    assert any("elastictk_steps_redone_total" in t["expr"] for t in redone["targets"])
    families, samples = exported()
    assert {"elastictk_recovery_phase_seconds", "elastictk_steps_redone_total"} <= families
    observed = set()
    with WorkerStepsBlock(1) as block:  # the phase label values a real agent gives
        reg = CollectorRegistry()
        AgentMetrics(reg, job="j", steps=block)("recovery", phases_ms={p: 1.0 for p in PHASES})
        for f in reg.collect():
            observed |= {s.labels["phase"] for s in f.samples if "phase" in s.labels}
    assert observed == set(PHASES) and {"detect", "rendezvous", "first_step"} <= observed


def test_dashboard_and_docs_name_only_real_metrics() -> None:
    families, samples = exported()
    dash = json.loads(DASHBOARD.read_text())
    for expr in exprs(dash):
        for name in NAME.findall(expr):
            assert name in samples, f"dashboard uses {name}, which is not exported"
    docs = DOCS.read_text()
    for name in set(NAME.findall(docs)):
        assert name in samples or name in families, f"docs/metrics.md names {name}, which is not exported"
    table = {m for line in docs.splitlines() if line.startswith("| `elastictk_")
             for m in NAME.findall(line.split("|")[1])}
    assert families == table, f"missing from the reference: {families - table}; not exported: {table - families}"


def test_every_dashboard_query_parses_in_prometheus(tmp_path: Path) -> None:
    try:
        prom = PrometheusServer([], base_dir=tmp_path)
    except PrometheusNotInstalled as e:
        pytest.skip(str(e))
    dash = json.loads(DASHBOARD.read_text())
    with prom:
        for expr in exprs(dash):
            concrete = expr.replace("$run_id", ".*").replace("$__rate_interval", "1m")
            prom.api("query", query=concrete)  # raises PrometheusError on a bad query

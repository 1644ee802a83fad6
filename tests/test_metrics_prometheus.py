"""A real Prometheus scrapes elastictk's exporter; every assertion asks Prometheus's HTTP API.

Prometheus (Debian's ``prometheus``, installed by ``make test``) runs on a loopback port with a
temp config and data dir, scraping every 200 ms; it is stopped and its dir removed after each
test, also on failure (the context manager), and dies with the test run if that is killed.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, Iterator

import pytest
from prometheus_client import CollectorRegistry

from elastictk.metrics import AgentMetrics, MetricsServer, read_events
from elastictk.store.endpoint import quiet_port
from elastictk.testing import PrometheusError, PrometheusNotInstalled, PrometheusServer

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "contrib" / "prometheus-alerts.yml"


@pytest.fixture
def prometheus_binary() -> str:
    from elastictk.testing.prometheus import find_prometheus

    try:
        return find_prometheus()
    except PrometheusNotInstalled as e:
        pytest.skip(str(e))


def test_prometheus_sees_the_restart_and_the_alert_fires(tmp_path: Path, prometheus_binary: str) -> None:
    reg = CollectorRegistry()
    m = AgentMetrics(reg, job="job-a", node="node-0", role="default", max_restarts=1, local_world_size=2)
    with MetricsServer(reg, port=0) as exporter, \
            PrometheusServer([exporter.target], rule_files=[RULES], base_dir=tmp_path) as prom:
        root = prom.root
        prom.wait_for('up{job="elastictk"}', lambda v: v == 1)
        assert prom.value('elastictk_restarts_total{run_id="job-a"}') == 0
        m("round_joined", round=0, rank=0, world=1)
        m("workers_started", attempt=0, restart_count=0, pids={0: 10, 1: 11})
        m("worker_failed", rank=1, local_rank=1, exit="SIGKILL", first_in_job=True)
        m("restart", restart_count=1, delay_s=0.0, reason="worker 1 was killed")
        m("workers_started", attempt=1, restart_count=1, pids={0: 12, 1: 13})
        prom.wait_for('elastictk_restarts_total{job="elastictk",run_id="job-a",node="node-0",role="default"}', lambda v: v == 1)
        assert prom.value('elastictk_worker_failures_total{reason="signal",detail="SIGKILL"}') == 1
        assert prom.value("elastictk_restarts_remaining") == 0
        assert prom.value("elastictk_workers_running") == 2
        assert prom.value("elastictk_recovery_duration_seconds_count") == 1
        # the shipped rule: the budget is spent, the next failure ends the job
        prom.wait_for('ALERTS{alertname="ElastictkRestartBudgetExhausted",alertstate="firing"}',
                      lambda v: v == 1)
        assert prom.value('ALERTS{alertname="ElastictkJobFailed"}') is None
        m("worker_failed", rank=0, local_rank=0, exit="code 1", first_in_job=True)
        m("job_failed", reason="no restarts left")
        prom.wait_for('ALERTS{alertname="ElastictkJobFailed",alertstate="firing",run_id="job-a"}', lambda v: v == 1)
    assert not root.exists()


def test_shipped_rules_pass_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    r = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_prometheus_start_failure_is_one_line_and_cleans_up(tmp_path: Path, prometheus_binary: str) -> None:
    prom = PrometheusServer(["127.0.0.1:1"], base_dir=tmp_path, scrape_interval=0.2)
    prom.config = lambda: "scrape_configs: [this is not: valid\n"  # type: ignore[method-assign]
    with pytest.raises(PrometheusError) as info:
        with prom:
            pass
    assert "prometheus exited" in str(info.value) and "\n" not in str(info.value)
    assert not prom.root.exists() and prom.pid is None


# -- an elastictk job end to end ------------------------------------------------------------------

# A custom launcher built from the public pieces: elastictk-run's agent with telemetry wired in
# (what ``--metrics-port``/``--event-log`` do), printing each event as a JSON line for the test.
DRIVER = """
import json, sys
from elastictk.cli import parse_args
from elastictk.metrics import Telemetry
from elastictk.agent import build_agent

config = parse_args(sys.argv[1:])
tel = Telemetry.from_launch(config, node="node-0")
agent, handle = build_agent(config, tel)
cfg = agent.config

def on_event(kind, **fields):
    tel.on_event(kind, **fields)
    print(json.dumps({"kind": kind, **fields}, default=str), flush=True)

cfg.on_event = on_event
print(json.dumps({"kind": "metrics", "target": tel.server.target, "job": config.run_id}), flush=True)
try:
    result = agent.run()
finally:
    handle.close()
    tel.close()
sys.exit(result.exit_code)
"""

WORKER = """
import os, sys, time
import elastictk.metrics as etm

assert etm.enabled(), "ELASTICTK_METRICS_SHM should reach the worker"
stop = sys.argv[1]
i = 0
while not os.path.exists(stop):
    with etm.step_timer():
        time.sleep(0.02)
    i += 1
    if i % 10 == 0:
        etm.checkpoint()
"""


def events_from(stdout: IO[str]) -> Iterator[dict[str, Any]]:
    for line in stdout:
        if line.startswith("{"):
            yield json.loads(line)


def next_event(events: Iterator[dict[str, Any]], kind: str) -> dict[str, Any]:
    for e in events:
        if e["kind"] == kind:
            return e
    pytest.fail(f"the job ended before a {kind!r} event")


def test_killed_worker_shows_up_in_prometheus(tmp_path: Path, prometheus_binary: str) -> None:
    worker, stop, log = tmp_path / "train.py", tmp_path / "stop", tmp_path / "events.jsonl"
    worker.write_text(WORKER)
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--start-method", "spawn",
             "--metrics-port", "0", "--event-log", str(log), "--log-dir", str(tmp_path / "logs"),
             str(worker), str(stop)]
    env = {k: v for k, v in os.environ.items() if k != "ELASTICTK_METRICS_SHM"}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, *flags], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert driver.stdout is not None
        events = events_from(driver.stdout)
        first = next_event(events, "metrics")
        job, target = first["job"], first["target"]
        sel = f'run_id="{job}",node="node-0"'
        with PrometheusServer([target], base_dir=tmp_path) as prom:
            started = next_event(events, "workers_started")
            # worker → shared block → exporter → Prometheus
            prom.wait_for(f"sum(elastictk_steps_total{{{sel}}})", lambda v: v is not None and v >= 10)
            prom.wait_for(f"elastictk_workers_running{{{sel}}}", lambda v: v == 2)
            assert prom.value(f"elastictk_restarts_total{{{sel}}}") == 0
            victim = int(started["pids"]["1"])
            os.kill(victim, signal.SIGKILL)
            failed = next_event(events, "worker_failed")
            assert failed["exit"] == "SIGKILL"
            next_event(events, "workers_started")
            prom.wait_for(f"elastictk_restarts_total{{{sel}}}", lambda v: v == 1)
            assert prom.value(f'elastictk_worker_failures_total{{{sel},reason="signal",detail="SIGKILL"}}') == 1
            assert prom.value(f"elastictk_restarts_remaining{{{sel}}}") == 1
            prom.wait_for(f"elastictk_recovery_duration_seconds_count{{{sel}}}", lambda v: v == 1)
            ratio = prom.wait_for(f"elastictk_goodput_ratio{{{sel}}}")
            assert ratio is not None and 0 < ratio <= 1
            steps_before = prom.value(f"sum(elastictk_steps_total{{{sel}}})")
            prom.wait_for(f"sum(elastictk_steps_total{{{sel}}})", lambda v: v is not None and v > (steps_before or 0))
        stop.write_text("")
        assert driver.wait(timeout=120) == 0
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=30)
        stderr = driver.stderr.read() if driver.stderr else ""
        for stream in (driver.stdout, driver.stderr):
            if stream is not None:
                stream.close()
    kinds = [e.kind for e in read_events(log)]
    assert kinds.count("workers_started") == 2 and "worker_failed" in kinds and "restart" in kinds, stderr[-2000:]
    assert kinds[-1] == "job_finished"
    (fail,) = read_events(log, kinds={"worker_failed"})
    assert fail.get("exit") == "SIGKILL" and fail.get("local_rank") == 1 and fail.run_id == job


# -- the failed-job alert, from a real elastictk-run ------------------------------------------------

FAILING = "import sys; sys.exit(3)\n"


def run_failing_job(tmp_path: Path, port: int, linger: str) -> tuple[subprocess.CompletedProcess[str], float]:
    script = tmp_path / "fail.py"
    script.write_text(FAILING)
    argv = [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "1",
            "--max-restarts", "0", "--metrics-port", str(port), "--metrics-linger", linger,
            "--log-dir", str(tmp_path / "logs"), str(script)]
    env = {k: v for k, v in os.environ.items() if k != "ELASTICTK_METRICS_SHM"}
    started = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, env=env, text=True, capture_output=True, timeout=180)
    return done, time.monotonic() - started


# 90 s: far beyond a loaded machine's job start (the time measured includes it), so a wait that
# ended at --metrics-linger instead of the first scrape is told apart from a slow start.
@pytest.mark.parametrize("linger", ["90", "0"], ids=["lingers", "no-linger"])
def test_failed_job_fires_the_shipped_alert(tmp_path: Path, prometheus_binary: str, linger: str) -> None:
    """A real elastictk-run job that fails, scraped by a real Prometheus with the shipped rules:
    the exporter stays up until a scrape has seen state="failed", and ElastictkJobFailed fires.
    Without the linger (--metrics-linger 0, what every failed job did before) the job exits at
    once, and the alert fires only if a scrape happened to land between the failure and the
    exit (a moment: usually none does, on a loaded machine sometimes one)."""
    port = quiet_port("127.0.0.1")
    with PrometheusServer([f"127.0.0.1:{port}"], rule_files=[RULES], base_dir=tmp_path) as prom:
        done, took = run_failing_job(tmp_path, port, linger)
        assert done.returncode == 1, done.stderr[-2000:]
        alert = 'ALERTS{alertname="ElastictkJobFailed",alertstate="firing"}'
        if linger == "0":
            assert "until one scrape" not in done.stderr
            time.sleep(10 * prom.scrape_interval)  # evaluations after the job's end
            seen = prom.value('max_over_time(elastictk_agent_state{state="failed"}[5m]) == 1')
            assert prom.value(f"max_over_time({alert}[5m])") == seen, "fires exactly when a scrape saw it"
            return
        (line,) = [x for x in done.stderr.splitlines() if "until one scrape" in x]
        assert f"127.0.0.1:{port}" in line and "at most 90s" in line and "Ctrl-C" in line
        assert took < 90, "the wait should end at the first scrape, not at --metrics-linger"
        fired = prom.wait_for(f"max_over_time({alert}[5m])", lambda v: v == 1)
        assert fired == 1
        (series,) = prom.query(f"max_over_time({alert}[5m])")
        assert series["metric"]["node"] and series["metric"]["run_id"]

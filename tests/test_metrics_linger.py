"""``--metrics-linger``: a failed job's exporter serves until one scrape has seen the failure.

Unit level (a Telemetry on port 0, scraped with urllib); the end-to-end proof that the shipped
alert fires is in test_metrics_prometheus.py.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from elastictk.cli import parse_args
from elastictk.cli.values import UsageError
from elastictk.metrics import MetricsServer, Telemetry, TelemetryError
from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parent.parent
FAILED = b'elastictk_agent_state{node="n0",role="default",run_id="r1",state="failed"} 1.0'


def telemetry(tmp_path: Path, linger: float) -> Telemetry:
    return Telemetry(job="r1", node="n0", local_world_size=None, metrics_port=0,
                     event_log=tmp_path / "events.jsonl", metrics_linger=linger)


def scrape(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        body: bytes = r.read()
        return body


def fail(t: Telemetry) -> None:
    t.on_event("round_joined", round=0, rank=0, world=1)
    t.on_event("workers_started", attempt=0, restart_count=0, pids={0: 1})
    t.on_event("job_failed", reason="no restarts left")


def test_close_after_failure_waits_for_one_scrape(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    t = telemetry(tmp_path, 30.0)
    assert t.server is not None
    url = t.server.url
    fail(t)
    bodies: list[bytes] = []

    def scraper() -> None:
        time.sleep(0.3)
        bodies.append(scrape(url))

    th = threading.Thread(target=scraper)
    th.start()
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="elastictk.metrics"):
        t.close()
    took = time.monotonic() - started
    th.join(10)
    assert 0.25 < took < 10 and FAILED in bodies[0]
    (line,) = [r.getMessage() for r in caplog.records if "until one scrape" in r.getMessage()]
    assert url in line and "at most 30s" in line and "--metrics-linger 0" in line
    assert t.server is None


def test_no_scrape_ends_the_wait_after_the_linger(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    t = telemetry(tmp_path, 0.4)
    fail(t)
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="elastictk.metrics"):
        assert t.linger() is False
    assert 0.35 < time.monotonic() - started < 5
    assert any("no scrape within 0.4s" in r.getMessage() for r in caplog.records)
    t.close()


def test_a_scrape_before_the_wait_does_not_count(tmp_path: Path) -> None:
    """Only a request read after the wait began is known to have seen the failed state."""
    t = telemetry(tmp_path, 0.4)
    assert t.server is not None
    scrape(t.server.url)
    fail(t)
    assert t.linger() is False
    t.close()


@pytest.mark.parametrize("event", ["job_finished", "signalled"])
def test_no_linger_unless_the_job_failed(tmp_path: Path, event: str) -> None:
    t = telemetry(tmp_path, 30.0)
    t.on_event("workers_started", attempt=0, restart_count=0, pids={0: 1})
    t.on_event(event)
    started = time.monotonic()
    assert t.linger() is None
    t.close()
    assert time.monotonic() - started < 2


def test_linger_zero_does_not_wait(tmp_path: Path) -> None:
    t = telemetry(tmp_path, 0.0)
    fail(t)
    assert t.linger() is None
    t.close()


def test_sigint_ends_the_wait_at_once(tmp_path: Path) -> None:
    t = telemetry(tmp_path, 30.0)
    fail(t)
    before = signal.getsignal(signal.SIGINT)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    assert t.linger() is False
    assert time.monotonic() - started < 5
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored
    t.close()  # the wait was had: closing does not wait again
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "5"])
def test_bad_linger_is_refused(tmp_path: Path, value: object) -> None:
    with pytest.raises(TelemetryError, match="metrics linger"):
        Telemetry(job="r1", metrics_port=0, event_log=tmp_path / "e.jsonl", metrics_linger=value)  # type: ignore[arg-type]


def test_wait_for_scrape_ends_when_the_server_closes() -> None:
    srv = MetricsServer(CollectorRegistry(), port=0)
    threading.Timer(0.2, srv.close).start()
    started = time.monotonic()
    assert srv.wait_for_scrape(srv.requests, 30.0) is False
    assert time.monotonic() - started < 5


# -- the flag ------------------------------------------------------------------------------------

SCRIPT = str(ROOT / "setup.py")


@pytest.mark.parametrize(("flags", "linger"), [
    (["--metrics-port", "0"], 0.0),  # a random port: no scrape config names it
    (["--metrics-port", "9300"], 60.0),
    (["--metrics-port", "9300", "--metrics-linger", "0"], 0.0),
    (["--metrics-port", "0", "--metrics-linger", "2.5"], 2.5),
    ([], 0.0),
])
def test_linger_defaults(flags: list[str], linger: float) -> None:
    assert parse_args(["--standalone", *flags, SCRIPT]).metrics_linger == linger


@pytest.mark.parametrize(("flags", "says"), [
    (["--metrics-linger", "5"], "--metrics-linger 5 keeps the metrics exporter up, and there is none"),
    (["--metrics-port", "0", "--metrics-linger", "nan"], "--metrics-linger nan: seconds must be a finite"),
    (["--metrics-port", "0", "--metrics-linger", "-1"], "--metrics-linger -1: seconds must be a finite"),
    (["--metrics-port", "0", "--metrics-linger", "1e9"], "--metrics-linger 1e9: seconds must be at most 3600"),
])
def test_bad_linger_flag_is_one_line(flags: list[str], says: str) -> None:
    with pytest.raises(UsageError, match="^" + says.replace("(", r"\(")):
        parse_args(["--standalone", *flags, SCRIPT])


def test_bad_linger_flag_exits_2_in_one_line(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "elastictk.run", "--standalone", "--metrics-linger", "x",
                        "--metrics-port", "0", SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "elastictk-run: error: --metrics-linger x: 'x' is not a number of seconds"], r.stderr

"""``--metrics-linger``: a failed job's exporter serves until one scrape has seen the failure.

Unit level (a Telemetry on port 0, scraped with urllib); the end-to-end proof that the shipped
alert fires is in test_metrics_prometheus.py.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.cli import parse_args
from elastictk.cli.values import UsageError
from elastictk.metrics import MetricsServer, Telemetry, TelemetryError
from elastictk.metrics.server import is_scrape
from tests.helpers.netns import Hosts, netns_works
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


class _Gate:
    """A collector that holds every response until ``open`` is set: the test decides what the
    client has done before the server answers."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def collect(self) -> list[object]:
        assert self.open.wait(60), "the test never opened the gate"
        return []


def _answered(srv: MetricsServer, requests: int) -> None:
    """Wait (an event, not a bound) until ``requests`` were read and every response is done."""
    deadline = time.monotonic() + 60
    while srv.requests < requests or srv.open_connections:
        assert time.monotonic() < deadline, (srv.requests, srv.open_connections)
        time.sleep(0.01)


def test_only_a_whole_scrape_of_metrics_ends_the_wait() -> None:
    """Another user's GET of another path (answered 200 with the metrics: the app serves every
    path) and a GET /metrics by a client that hung up before the answer came do not
    count as the scrape that saw the failure; a GET /metrics read whole does."""
    registry = CollectorRegistry()
    gate = _Gate()
    registry.register(gate)  # type: ignore[arg-type]
    with MetricsServer(registry, port=0) as srv:
        after = srv.requests
        gate.open.set()
        for path in ("/not-metrics-at-all", "/metrics/x", "/"):
            assert urllib.request.urlopen(f"http://{srv.target}{path}", timeout=30).status == 200
        gate.open.clear()
        with socket.create_connection((srv.host, srv.port), timeout=30) as c:
            c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            _wait_read(srv, after + 4)
        gate.open.set()  # the client is gone before its answer is sent: its kernel resets it
        _answered(srv, after + 4)
        assert srv.wait_for_scrape(after, 0) is False
        assert scrape(srv.url) == b""
        assert srv.wait_for_scrape(after, 30) is True  # the failing side: a whole scrape counts


def test_a_scrape_whose_client_is_cut_off_before_the_answer_does_not_count() -> None:
    """The answer fits the server's socket buffer, so ``sendall`` and the shutdown succeed
    although the client (on another host, its cable cut) never gets a byte: only the client's
    acknowledgement of every byte makes it a scrape that saw the failure."""
    why = netns_works()
    if why is not None:
        pytest.skip(why)
    registry = CollectorRegistry()
    gate = _Gate()
    registry.register(gate)  # type: ignore[arg-type]
    with Hosts(2) as hosts:
        server, client = hosts[0], hosts[1]
        srv = server.call(lambda: MetricsServer(registry, host=server.addr, port=0, request_timeout=2.0))
        conn = client.call(socket.create_connection, (server.addr, srv.port), 30)
        try:
            after = srv.requests
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            _wait_read(srv, after + 1)
            client.link_down()
            gate.open.set()
            _answered(srv, after + 1)
            assert srv.wait_for_scrape(after, 0) is False
        finally:
            conn.close()
            srv.close()


def _wait_read(srv: MetricsServer, requests: int) -> None:
    deadline = time.monotonic() + 60
    while srv.requests < requests:
        assert time.monotonic() < deadline, srv.requests
        time.sleep(0.01)


@pytest.mark.parametrize(("head", "scrape_"), [
    (b"GET /metrics HTTP/1.1\r\n\r\n", True), (b"GET /metrics?name[]=x HTTP/1.1\r\n\r\n", True),
    (b"GET /%6detrics HTTP/1.0\r\n\r\n", True), (b"GET /metricsx HTTP/1.1\r\n\r\n", False),
    (b"HEAD /metrics HTTP/1.1\r\n\r\n", False), (b"GET / HTTP/1.1\r\n\r\n", False),
    (b"POST /metrics HTTP/1.1\r\n\r\n", False), (b"GET /metrics\r\n\r\n", False), (b"", False),
])
def test_what_counts_as_a_scrape(head: bytes, scrape_: bool) -> None:
    assert is_scrape(head) is scrape_


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_any_request_head_is_judged_without_raising(head: bytes) -> None:
    assert is_scrape(head) in (True, False)


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

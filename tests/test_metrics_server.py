"""The HTTP exporter and the Telemetry bundle: serve, shut down cleanly, fail clearly."""
from __future__ import annotations

import http.client
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.parser import text_string_to_metric_families

from elastictk.cli import parse_args
from elastictk.metrics import ENV_PATH, MetricsServer, MetricsServerError, Telemetry, read_events

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "helpers" / "agent_worker.py")


def fetch(host: str, port: int, path: str = "/metrics") -> tuple[int, str]:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def my_sockets(port: int) -> list[Any]:
    return [c for c in psutil.Process().net_connections(kind="inet")
            if (c.laddr and c.laddr.port == port) or (c.raddr and c.raddr.port == port)]


def server_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("elastictk-metrics") or "process_request" in t.name]


def registry_with_a_counter() -> CollectorRegistry:
    reg = CollectorRegistry()
    Counter("elastictk_test_things", "things", ["job"], registry=reg).labels("j").inc(3)
    return reg


def test_port_zero_picks_a_free_port_and_close_leaves_nothing() -> None:
    threads_before = {t.ident for t in threading.enumerate()}
    srv = MetricsServer(registry_with_a_counter(), port=0)
    try:
        assert srv.port > 0 and srv.url == f"http://127.0.0.1:{srv.port}/metrics"
        assert srv.target == f"127.0.0.1:{srv.port}"
        status, text = fetch("127.0.0.1", srv.port)
        assert status == 200
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples["elastictk_test_things_total"] == 3
    finally:
        srv.close()
    srv.close()  # idempotent
    assert not my_sockets(srv.port)
    assert {t.ident for t in threading.enumerate()} <= threads_before
    with pytest.raises(OSError):
        fetch("127.0.0.1", srv.port)


def test_a_stalled_client_cannot_hold_up_close() -> None:
    srv = MetricsServer(registry_with_a_counter(), port=0, request_timeout=0.5)
    stalled = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    try:
        stalled.sendall(b"GET /metr")  # never finishes its request
        deadline = time.monotonic() + 30
        while not server_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server_threads()  # the request is being served, and stalls
        srv.close()  # joins the request thread once its read times out
        assert not [t for t in server_threads() if t.is_alive()]
    finally:
        stalled.close()
    assert not [c for c in my_sockets(srv.port) if c.status == psutil.CONN_LISTEN]


def test_a_taken_port_is_one_clear_line() -> None:
    with MetricsServer(registry_with_a_counter(), port=0) as first:
        with pytest.raises(MetricsServerError) as info:
            MetricsServer(registry_with_a_counter(), port=first.port)
    msg = str(info.value)
    assert "\n" not in msg and f"127.0.0.1:{first.port}" in msg and "--metrics-port" in msg
    with pytest.raises(MetricsServerError, match="0 .any free port. to 65535"):
        MetricsServer(registry_with_a_counter(), port=70000)


def test_serves_on_ipv6_loopback() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        srv = MetricsServer(registry_with_a_counter(), host="::1", port=0)
    except MetricsServerError as e:
        pytest.skip(f"IPv6 loopback unavailable: {e}")
    with srv:
        assert srv.url == f"http://[::1]:{srv.port}/metrics"
        assert fetch("::1", srv.port)[0] == 200


def test_telemetry_from_elastictk_run_flags(tmp_path: Path) -> None:
    log = tmp_path / "ev" / "events.jsonl"
    config = parse_args(["--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
                         "--metrics-port", "0", "--event-log", str(log), "--role", "trainer",
                         SCRIPT, str(tmp_path)])
    with Telemetry.from_launch(config, node="node-a") as tel:
        env = tel.worker_env()
        assert set(env) == {ENV_PATH, "ELASTICTK_WORKER_HOOKS"}
        assert "elastictk.metrics.worker" in env["ELASTICTK_WORKER_HOOKS"].split(",")
        assert tel.metrics_url is not None and tel.server is not None
        tel.on_event("workers_started", attempt=0, restart_count=0, pids={0: 1, 1: 2})
        tel.on_event("worker_failed", rank=1, local_rank=1, exit="SIGTERM", first_in_job=True)
        tel.on_event("restart", restart_count=1, delay_s=0, reason="x")
        _, text = fetch("127.0.0.1", tel.server.port)
        samples = {(s.name, s.labels.get("reason")): s for f in text_string_to_metric_families(text)
                   for s in f.samples}
        restarts = samples[("elastictk_restarts_total", None)]
        assert restarts.value == 1
        assert restarts.labels == {"run_id": config.run_id, "node": "node-a", "role": "trainer"}
        assert samples[("elastictk_restarts_remaining", None)].value == 2
        assert samples[("elastictk_worker_failures_total", "signal")].value == 1
        port = tel.server.port
    assert not my_sockets(port)
    assert [e.kind for e in read_events(log)] == ["workers_started", "worker_failed", "restart"]
    assert all(e.run_id == config.run_id for e in read_events(log))


def test_telemetry_without_a_port_only_records_events(tmp_path: Path) -> None:
    with Telemetry(job="j", local_world_size=2) as tel:
        assert tel.server is None and tel.metrics is None and tel.worker_env() == {}
        tel.on_event("round_joined", round=0, rank=0, world=1)
        tel.on_event("workers_started", attempt=0, restart_count=0, pids={}, run_dir=str(tmp_path / "j"))
    assert [e.kind for e in read_events(tmp_path / "j" / "events.jsonl")] == ["round_joined", "workers_started"]


def test_telemetry_setup_errors_are_one_line_and_leave_nothing(tmp_path: Path) -> None:
    from elastictk.metrics import TelemetryError

    def memfds() -> int:
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += "elastictk-steps" in os.readlink(f"/proc/self/fd/{fd}")
            except FileNotFoundError:  # the fd listdir itself used
                pass
        return n

    before = memfds()
    with MetricsServer(registry_with_a_counter(), port=0) as taken:
        with pytest.raises(TelemetryError) as info:
            Telemetry(job="j", local_world_size=2, metrics_port=taken.port)
        assert "--metrics-port" in str(info.value) and "\n" not in str(info.value)
    assert memfds() == before  # the steps block made before the bind failed was freed
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(TelemetryError, match="cannot write event log"):
        Telemetry(job="j", event_log=str(blocker / "events.jsonl"))


# -- clients that misbehave: slow, silent, not reading, too many -----------------------------------
class _BigHelp(Collector):
    """A collector whose exposition is ~20 MB (one long HELP text): more than socket buffers hold."""

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("elastictk_test_big", "x" * 20_000_000, value=1)


def _dropped(sock: socket.socket, within: float) -> bool:
    """Whether the server closed ``sock`` (EOF or reset) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_close_returns_at_once_whatever_slow_clients_do() -> None:
    reg = registry_with_a_counter()
    reg.register(_BigHelp())
    srv = MetricsServer(reg, port=0, request_timeout=30)  # far longer than close() may take
    clients: list[socket.socket] = []
    stop = threading.Event()

    def trickle(sock: socket.socket) -> None:  # one byte a second, never a whole request
        try:
            for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n" * 100:
                sock.sendall(bytes([byte]))
                if stop.wait(1.0):
                    return
        except OSError:
            return

    closer = threading.Thread(target=srv.close, name="test-close", daemon=True)
    trickler: threading.Thread | None = None
    try:
        silent = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        clients.append(silent)
        slow = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        clients.append(slow)
        trickler = threading.Thread(target=trickle, args=(slow,), name="test-trickle", daemon=True)
        trickler.start()
        deaf = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        clients.append(deaf)
        deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        deaf.settimeout(30)
        deaf.connect(("127.0.0.1", srv.port))
        deaf.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert deaf.recv(1) == b"H"  # the response has started; now it stops reading
        time.sleep(1.5)  # the trickler has sent a byte or two; the sender is blocked
        serving = [t for t in server_threads() if t.name != f"elastictk-metrics-{srv.port}"]
        assert len(serving) == 1  # the deaf client's response; the other two wait without a thread
        assert srv.pending_connections == 2
        start = time.monotonic()
        closer.start()
        closer.join(timeout=1.5)
        took = time.monotonic() - start
        assert not closer.is_alive(), "close() waited on slow clients"
        assert took < 1.5
    finally:
        stop.set()
        for c in clients:
            c.close()  # on a server that ignores its clients this is what releases close()
        if trickler is not None:
            trickler.join(timeout=30)
        if closer.ident is None:  # failed before close() was called
            srv.close()
        else:
            closer.join(timeout=60)
    assert not [t for t in server_threads() if t.is_alive()]
    assert not my_sockets(srv.port)


def test_a_client_trickling_bytes_is_dropped_at_the_request_deadline() -> None:
    with MetricsServer(registry_with_a_counter(), port=0, request_timeout=0.5) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as slow:
            start, dropped = time.monotonic(), False
            request = b"GET /metrics HTTP/1.1\r\n" + b"X-Pad: y\r\n" * 100
            for byte in request:  # a byte every 0.1 s, for at most 3 s
                if time.monotonic() - start > 3:
                    break
                try:
                    slow.sendall(bytes([byte]))
                except OSError:
                    dropped = True
                    break
                if _dropped(slow, 0.1):
                    dropped = True
                    break
            assert dropped and time.monotonic() - start < 2.0
        assert fetch("127.0.0.1", srv.port)[0] == 200  # a normal scrape is served as before


def test_a_scrape_succeeds_while_32_idle_connections_are_open() -> None:
    with MetricsServer(registry_with_a_counter(), port=0, request_timeout=30) as srv:
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=30) for _ in range(32)]
        try:
            t0 = time.monotonic()
            status, text = fetch("127.0.0.1", srv.port)
            assert status == 200 and 'elastictk_test_things_total{job="j"} 3.0' in text
            assert time.monotonic() - t0 < 2.0
            assert not any(_dropped(c, 0.01) for c in idle), "idle clients are kept until their deadline"
            assert srv.pending_connections == 32
            assert len([t for t in server_threads() if "conn" in t.name]) == 0, "idle clients hold no thread"
        finally:
            for c in idle:
                c.close()


def test_past_max_pending_the_oldest_idle_connection_makes_room() -> None:
    cap = 4
    with MetricsServer(registry_with_a_counter(), port=0, request_timeout=30, max_pending=cap) as srv:
        clients = [socket.create_connection(("127.0.0.1", srv.port), timeout=30) for _ in range(cap + 5)]
        try:
            time.sleep(0.2)
            dropped = [i for i, c in enumerate(clients) if _dropped(c, 0.3)]
            assert dropped == list(range(5)), dropped  # the oldest go; the newest wait
            assert srv.pending_connections == cap
            assert fetch("127.0.0.1", srv.port)[0] == 200  # and a scrape is never kept out
        finally:
            for c in clients:
                c.close()


def test_whole_requests_past_max_connections_get_503_at_once() -> None:
    reg = registry_with_a_counter()
    reg.register(_BigHelp())
    with MetricsServer(reg, port=0, request_timeout=30, max_connections=1) as srv:
        deaf = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        deaf.settimeout(30)
        try:
            deaf.connect(("127.0.0.1", srv.port))
            deaf.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert deaf.recv(1) == b"H"  # its response is being sent; it stops reading
            assert srv.open_connections == 1
            status, _ = fetch("127.0.0.1", srv.port)
            assert status == 503
        finally:
            deaf.close()

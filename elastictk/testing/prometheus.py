"""Launch a real, local Prometheus that scrapes elastictk exporters (tests, demos, one machine).

A :class:`PrometheusServer` owns one ``prometheus`` process and a temp dir with its config,
data and log; it binds only to loopback by default, on a free port, and dies with its owner
(``PR_SET_PDEATHSIG``), so a SIGKILLed test run leaves no Prometheus behind. Queries go through
its HTTP API (``/api/v1/query``), the way a dashboard or an alert rule sees the metrics.
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Sequence

from ..lifetime.reaper import dies_with_caller
from ..store.endpoint import quiet_port
from .binary import find_binary

INSTALL_HINT = ("install it with `apt-get install prometheus` (2.x), or point ELASTICTK_PROMETHEUS "
                "at a prometheus binary")


class PrometheusNotInstalled(RuntimeError):
    """No prometheus binary was found; the message says how to install one."""


class PrometheusError(RuntimeError):
    """Prometheus did not start, or a query failed; the message says what it answered."""


def find_prometheus(binary: str | os.PathLike[str] | None = None) -> str:
    return find_binary("prometheus", "ELASTICTK_PROMETHEUS", binary, PrometheusNotInstalled, INSTALL_HINT)


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


class PrometheusServer:
    """``with PrometheusServer(["127.0.0.1:9100"]) as prom: prom.wait_for("up", ...)``.

    ``targets`` are ``host:port`` exporters scraped every ``scrape_interval`` seconds as scrape
    job ``job``, with Prometheus's default label handling (no ``honor_labels``: elastictk's
    series carry ``run_id``, never ``job``, so nothing collides). ``rule_files`` are
    alerting/recording rule files evaluated at the same interval.
    """

    def __init__(self, targets: Sequence[str], *, job: str = "elastictk", scrape_interval: float = 0.2,
                 rule_files: Sequence[str | os.PathLike[str]] = (), host: str = "127.0.0.1",
                 port: int = 0, base_dir: str | os.PathLike[str] | None = None,
                 binary: str | os.PathLike[str] | None = None, start_timeout: float = 60.0) -> None:
        self.binary = find_prometheus(binary)
        self.targets, self.job = list(targets), job
        self.scrape_interval = scrape_interval
        self.rule_files = [str(Path(r).resolve()) for r in rule_files]
        self.host, self._auto_port = host, port == 0
        self.port = port or quiet_port(host)
        self.start_timeout = start_timeout
        self.root = Path(tempfile.mkdtemp(prefix="elastictk-prometheus-", dir=base_dir))
        self.config_path, self.log_path = self.root / "prometheus.yml", self.root / "prometheus.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def config(self) -> str:
        every = _duration(self.scrape_interval)
        lines = [
            "global:", f"  scrape_interval: {every}", f"  scrape_timeout: {every}",
            f"  evaluation_interval: {every}",
        ]
        if self.rule_files:
            lines += ["rule_files:"] + [f"  - {json.dumps(r)}" for r in self.rule_files]
        lines += [
            "scrape_configs:", f"  - job_name: {json.dumps(self.job)}",
            "    static_configs:", f"      - targets: {json.dumps(self.targets)}",
        ]
        return "\n".join(lines) + "\n"

    def command(self) -> list[str]:
        return [
            self.binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.root / 'data'}",
            f"--web.listen-address={self.host}:{self.port}", "--log.level=warn",
        ]

    # -- lifetime ----------------------------------------------------------------------------
    def start(self) -> "PrometheusServer":
        self.config_path.write_text(self.config())
        for attempt in range(3):
            self._launch()
            try:
                self._wait_ready()
                return self
            except PrometheusError as e:
                if attempt == 2 or not self._auto_port or "address already in use" not in str(e):
                    raise
                self.port = quiet_port(self.host)  # another process took the port we picked
        return self

    def _launch(self) -> None:
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.command(), cwd=self.root, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, close_fds=True, start_new_session=True,
                preexec_fn=dies_with_caller(),
            )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        pause = 0.05
        while True:
            proc = self._proc
            assert proc is not None
            if proc.poll() is not None:
                self._proc = None
                raise PrometheusError(f"prometheus exited (code {proc.returncode}) while starting "
                                      f"on {self.host}:{self.port}: {self._last_error()}; log: {self.log_path}")
            if self._ready():
                return
            if time.monotonic() >= deadline:
                self.stop()
                raise PrometheusError(f"prometheus on {self.host}:{self.port} was not ready within "
                                      f"{self.start_timeout:g}s: {self._last_error()}; log: {self.log_path}")
            try:  # wakes at once if prometheus exits
                proc.wait(timeout=pause)
            except subprocess.TimeoutExpired:
                pass
            pause = min(pause * 2, 0.5)

    def _ready(self) -> bool:
        try:
            status, _ = self._get("/-/ready", timeout=2.0)
        except PrometheusError:
            return False
        return status == 200

    def _last_error(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "no log written"
        errors = [line for line in lines if "level=error" in line or "err=" in line]
        return ((errors or lines or ["no error logged"])[-1]).strip()[:300]

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; keeps the temp dir."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.wait(timeout=30)

    def close(self) -> None:
        """Stop Prometheus and remove its temp dir (config, data, log)."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "PrometheusServer":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- the HTTP API ----------------------------------------------------------------------------
    def _get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise PrometheusError(f"prometheus at {self.url} did not answer {path}: {e}") from None
        finally:
            conn.close()

    def api(self, path: str, **params: str) -> Any:
        """``data`` of a ``/api/v1/...`` answer; :class:`PrometheusError` if it reports an error."""
        status, body = self._get(f"/api/v1/{path}?{urllib.parse.urlencode(params)}")
        try:
            answer = json.loads(body)
        except ValueError:
            raise PrometheusError(f"prometheus answered {path} with HTTP {status}, not JSON") from None
        if answer.get("status") != "success":
            raise PrometheusError(f"prometheus {path} failed: {answer.get('errorType')}: {answer.get('error')}")
        return answer.get("data")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector: ``[{"metric": {labels}, "value": [t, "v"]}, ...]``."""
        data = self.api("query", query=expr)
        if data.get("resultType") != "vector":
            raise PrometheusError(f"query {expr!r} gave a {data.get('resultType')}, not a vector")
        return list(data.get("result", []))

    def value(self, expr: str) -> float | None:
        """The first sample's value of an instant query, or ``None`` when it has none."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, expr: str, predicate: Callable[[float | None], bool] = lambda v: v is not None,
                 timeout: float = 60.0) -> float | None:
        """Query ``expr`` until ``predicate(value)`` holds (Prometheus has no push: it is asked
        once per scrape interval); :class:`PrometheusError` with the last value on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            v = self.value(expr)
            if predicate(v):
                return v
            if time.monotonic() >= deadline:
                raise PrometheusError(f"{expr!r} did not reach the expected value within {timeout:g}s "
                                      f"(last: {v}); targets: {self.api('targets')['activeTargets']}")
            time.sleep(self.scrape_interval)

"""Launch a real, local ``etcd`` for tests, benchmarks and single-machine jobs.

An :class:`EtcdServer` owns one etcd process and a temp dir holding its data and log. It binds
only to loopback by default, on free ports that it keeps for its whole life, so it can be
stopped and started again on the same ports and data (a store outage that heals, as the chaos
"store-outage" fault and failover tests need). The process dies with its owner: it is started
with ``PR_SET_PDEATHSIG`` = SIGKILL, so a SIGKILLed test run leaves no etcd behind.

:class:`EtcdCluster` (``etcdcluster``) starts several of them as one cluster.

TLS mode: ``EtcdServer(tls=certs)`` (certificates from ``testcerts.make_test_certs``) serves
its client port over HTTPS and requires a client certificate signed by that CA
(``--cert-file --key-file --trusted-ca-file --client-cert-auth``). Peers stay on plain HTTP,
loopback only.
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Sequence

from ..lifetime.procfs import is_frozen
from ..lifetime.reaper import dies_with_caller
from ..store.base import Deadline
from ..store.endpoint import Endpoint, quiet_port
from .binary import find_binary
from .testcerts import TestCerts

INSTALL_HINT = (
    "install it with `apt-get install etcd-server` (etcd 3.4+), or point ELASTICTK_ETCD at an "
    "etcd binary"
)
# Resolved once here, so the forked child (before exec) only calls it: no dlopen, no lookup.


class EtcdNotInstalled(RuntimeError):
    """No etcd binary was found; the message says how to install one."""


class EtcdStartError(RuntimeError):
    """etcd did not become healthy; the message quotes its last error and names its log."""


def find_etcd(binary: str | os.PathLike[str] | None = None) -> str:
    """The etcd binary to run: ``binary``, else ``$ELASTICTK_ETCD``, else ``etcd`` on PATH,
    else ``/usr/bin/etcd``."""
    return find_binary("etcd", "ELASTICTK_ETCD", binary, EtcdNotInstalled, INSTALL_HINT)


def _last_error(log: Path) -> str:
    """The most telling line of etcd's (zap JSON) log, for a one-line startup error."""
    try:
        lines = log.read_text(errors="replace").splitlines()[-200:]
    except OSError:
        return "no log written"
    best = ""
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            best = line.strip() or best
            continue
        if isinstance(entry, dict) and entry.get("level") in ("error", "fatal", "panic", "warn"):
            text = str(entry.get("msg", ""))
            if entry.get("error"):
                text += f": {entry['error']}"
            best = text
    return (best or "no error logged")[:300]


class EtcdServer:
    """One etcd member as a context manager: ``with EtcdServer() as etcd: etcd.endpoint``.

    ``client_port``/``peer_port`` 0 pick free ports (kept across restarts). ``initial_cluster``
    (``name=http://host:peer_port,...``) and ``cluster_state`` make it one member of a larger
    cluster; by default it is a cluster of one. ``base_dir`` is where its temp dir goes.
    ``tls`` (:func:`make_test_certs`) serves the client port over HTTPS, requiring a client
    certificate signed by ``tls.ca``; ``client_url`` is then ``https://``.
    """

    def __init__(
        self,
        *,
        name: str = "etcd0",
        host: str = "127.0.0.1",
        client_port: int = 0,
        peer_port: int = 0,
        initial_cluster: str | None = None,
        cluster_state: str = "new",
        cluster_token: str | None = None,
        base_dir: str | os.PathLike[str] | None = None,
        binary: str | os.PathLike[str] | None = None,
        start_timeout: float = 60.0,
        stop_grace: float = 10.0,
        extra_args: Sequence[str] = (),
        tls: TestCerts | None = None,
    ) -> None:
        self.binary = find_etcd(binary)
        self.tls = tls
        self.name, self.host = name, host
        self._auto_ports = not client_port and not peer_port
        self.client_port = client_port or quiet_port(host)
        self.peer_port = peer_port or quiet_port(host)
        self.initial_cluster = initial_cluster
        self.cluster_state = cluster_state
        self.cluster_token = cluster_token or f"elastictk-{uuid.uuid4().hex[:12]}"
        self.start_timeout, self.stop_grace = start_timeout, stop_grace
        self.extra_args = list(extra_args)
        self.root = Path(tempfile.mkdtemp(prefix="elastictk-etcd-", dir=base_dir))
        self.data_dir, self.log_path = self.root / "data", self.root / "etcd.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._closed = False

    # -- addresses -----------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """``host:port`` of the client port, as :class:`EtcdStore` takes it."""
        return str(Endpoint(self.host, self.client_port))

    @property
    def peer_endpoint(self) -> str:
        return str(Endpoint(self.host, self.peer_port))

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.peer_endpoint}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running and self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        return [
            self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster or f"{self.name}={self.peer_url}",
            "--initial-cluster-state", self.cluster_state,
            "--initial-cluster-token", self.cluster_token,
            "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn",
            *self._tls_args(), *self.extra_args,
        ]

    def _tls_args(self) -> list[str]:
        if self.tls is None:
            return []
        return ["--cert-file", str(self.tls.server_cert), "--key-file", str(self.tls.server_key),
                "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]

    # -- lifetime ------------------------------------------------------------------------------
    def launch(self) -> None:
        """Start etcd without waiting for it to serve (a cluster's members start together)."""
        if self._closed:
            raise RuntimeError(f"etcd {self.name} at {self.endpoint} was closed; make a new one")
        if self.running:
            return
        # etcd reads ETCD_* variables as flags and refuses ones that shadow our flags.
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, close_fds=True, start_new_session=True,
                preexec_fn=dies_with_caller(),
            )

    def wait_ready(self, timeout: float | None = None) -> None:
        """Return once etcd reports healthy (it has a leader); :class:`EtcdStartError` if not."""
        t = self.start_timeout if timeout is None else timeout
        deadline = Deadline(t)
        pause = 0.02
        while True:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                code = None if proc is None else proc.returncode
                raise EtcdStartError(
                    f"etcd {self.name} exited (code {code}) while starting on {self.endpoint}: "
                    f"{_last_error(self.log_path)}; log: {self.log_path}"
                )
            if self._healthy(min(1.0, deadline.remaining() or 0.0)):
                return
            if deadline.expired():
                self.stop()
                raise EtcdStartError(
                    f"etcd {self.name} on {self.endpoint} was not healthy within {t:g}s: "
                    f"{_last_error(self.log_path)}; log: {self.log_path}"
                )
            try:  # wakes at once if etcd exits; otherwise probe again a little later
                proc.wait(timeout=min(pause, deadline.remaining() or 0.0))
            except subprocess.TimeoutExpired:
                pass
            pause = min(pause * 2, 0.25)

    def _healthy(self, timeout: float) -> bool:
        t = max(timeout, 0.05)
        conn = (http.client.HTTPConnection(self.host, self.client_port, timeout=t)
                if self.tls is None else http.client.HTTPSConnection(
                    self.host, self.client_port, timeout=t, context=self.tls.client_context()))
        try:
            conn.request("GET", "/health")
            resp = conn.getresponse()
            body = resp.read()
            return resp.status == 200 and json.loads(body).get("health") == "true"
        except (OSError, http.client.HTTPException, ValueError, AttributeError):
            return False
        finally:
            conn.close()

    def start(self) -> "EtcdServer":
        """Start (or restart, on the same ports and data) and wait until healthy."""
        for attempt in range(3):
            self.launch()
            try:
                self.wait_ready()
                return self
            except EtcdStartError as e:
                # Another process took an auto-picked port between quiet_port() and etcd's bind.
                fresh = self._auto_ports and not self.data_dir.exists()
                if attempt == 2 or not fresh or "address already in use" not in str(e):
                    raise
                self.client_port, self.peer_port = quiet_port(self.host), quiet_port(self.host)
        return self

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; keeps ports and data for :meth:`start`."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a paused etcd cannot act on SIGTERM
            g = self.stop_grace if grace is None else grace
            if g > 0:
                proc.terminate()
                try:
                    proc.wait(timeout=g)
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is None:
                proc.kill()
        proc.wait(timeout=30)

    def pause(self) -> None:
        """SIGSTOP: etcd keeps its sockets but answers nothing (a hung host, not a dead one).

        Returns once the kernel shows etcd stopped: the signal is delivered asynchronously, and a
        request sent in between would still be answered (seen as 1 in 4 under load)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGSTOP)
            deadline = Deadline(10.0)
            while not is_frozen(self._proc.pid) and not deadline.expired() and self._proc.poll() is None:
                time.sleep(0.001)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL at once, like a crashed host (data stays for :meth:`start`)."""
        self.stop(grace=0)

    def close(self) -> None:
        """Stop etcd and remove its temp dir. Idempotent."""
        if self._closed:
            return
        try:
            self.stop()
        finally:
            self._closed = True
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "EtcdServer":
        return self if self.running else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"EtcdServer({self.name!r}, {self.endpoint}, {state})"

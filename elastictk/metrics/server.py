"""``MetricsServer``: one registry served at ``/metrics`` over HTTP, with a clean shutdown.

prometheus-client's own ``start_http_server`` serves a registry well but leaves daemon request
threads (and their sockets) behind when shut down; this server uses its WSGI app on a threaded
``wsgiref`` server whose :meth:`MetricsServer.close` stops accepting, joins the serving thread
and every request thread (a client that stalls is dropped after ``request_timeout``), and
closes the listening socket. Port 0 binds a free port; :attr:`MetricsServer.port` says which.
"""
from __future__ import annotations

import logging
import socket
import threading
from socketserver import ThreadingMixIn
from types import TracebackType
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger("elastictk.metrics")


class MetricsServerError(RuntimeError):
    """The exporter could not bind; the message names the address and the fix."""


class _Handler(WSGIRequestHandler):
    timeout = 10.0  # a client that sends nothing is dropped, so close() never waits on it

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics http: " + format, *args)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = False
    block_on_close = True  # server_close() joins the request threads
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """``with MetricsServer(registry, port=0) as srv: print(srv.url)``; starts serving at once."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, *,
                 request_timeout: float = 10.0) -> None:
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise MetricsServerError(f"metrics port {port!r}: use 0 (any free port) to 65535")
        app = make_wsgi_app(registry)
        handler = type("Handler", (_Handler,), {"timeout": request_timeout})
        server_class = _Server6 if ":" in host else _Server
        try:
            self._server = make_server(host, port, app, server_class=server_class, handler_class=handler)
        except OSError as e:
            raise MetricsServerError(
                f"cannot serve metrics on {_hostport(host, port)}: {e.strerror or e}; "
                "pick another --metrics-port (0 picks a free one) or --metrics-host") from None
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name=f"elastictk-metrics-{self.port}", daemon=True)
        self._thread.start()
        self._closed = False
        log.info("serving Prometheus metrics at %s", self.url)

    @property
    def url(self) -> str:
        return f"http://{_hostport(self.host, self.port)}/metrics"

    @property
    def target(self) -> str:
        """``host:port``, as a Prometheus scrape config names it."""
        return _hostport(self.host, self.port)

    def close(self) -> None:
        """Stop serving and release the thread and sockets; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()  # returns once serve_forever has returned
        self._server.server_close()  # closes the socket, joins request threads
        self._thread.join(timeout=30)

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

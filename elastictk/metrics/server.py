"""``MetricsServer``: one registry served at ``/metrics`` over HTTP, with a shutdown no client can stall.

prometheus-client's own ``start_http_server`` serves a registry well but leaves daemon request
threads (and their sockets) behind when shut down, and ``wsgiref``'s server lets a client that
sends one byte now and then hold a request thread, and so ``close()``, for as long as it likes.
This server runs prometheus-client's WSGI app behind a small HTTP/1.1 front end of its own
(one request per connection, ``Connection: close``):

- a per-request deadline: a client that has not sent its whole request within
  ``request_timeout`` seconds of connecting is dropped, however it trickles bytes in; a client
  that does not read its response is dropped ``request_timeout`` seconds into sending it;
- idle connections cost no thread and block nobody: the accept loop itself reads request heads
  from every connection without blocking, and only a connection whose whole request has arrived
  gets a thread. At most ``max_pending`` connections wait for their request (a new one closes
  the oldest, whose deadline is nearest), so a crowd of idle clients cannot keep a scrape out;
- a cap on responses being sent at once: past ``max_connections`` a whole request is answered
  ``503`` at once;
- :meth:`MetricsServer.close` stops accepting, shuts every open connection down (which wakes
  its thread at once, whatever the client does), joins the threads and returns within
  :data:`CLOSE_WAIT` seconds.

Port 0 binds a free port; :attr:`MetricsServer.port` says which.
"""
from __future__ import annotations

import fcntl
import io
import logging
import os
import selectors
import socket
import struct
import sys
import termios
import threading
import time
from types import TracebackType
from typing import Any, Callable, Iterable
from urllib.parse import unquote

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger("elastictk.metrics")

MAX_REQUEST_BYTES = 16 * 1024
"""The most a request line and its headers may take; a longer request is dropped."""
CLOSE_WAIT = 0.8
"""The longest :meth:`MetricsServer.close` waits for request threads once their sockets are shut."""
DEFAULT_MAX_CONNECTIONS = 16
DEFAULT_MAX_PENDING = 128

_TCP_CLOSE = 7  # TCP_INFO's tcpi_state once the connection is gone (include/net/tcp_states.h)

_App = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class MetricsServerError(RuntimeError):
    """The exporter could not bind; the message names the address and the fix."""


class MetricsServer:
    """``with MetricsServer(registry, port=0) as srv: print(srv.url)``; starts serving at once."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, *,
                 request_timeout: float = 10.0, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise MetricsServerError(f"metrics port {port!r}: use 0 (any free port) to 65535")
        if not request_timeout > 0:
            raise MetricsServerError(f"metrics request timeout {request_timeout!r}: use a number of seconds > 0")
        if not isinstance(max_connections, int) or max_connections < 1:
            raise MetricsServerError(f"metrics max_connections {max_connections!r}: use 1 or more")
        if not isinstance(max_pending, int) or max_pending < 1:
            raise MetricsServerError(f"metrics max_pending {max_pending!r}: use 1 or more")
        self.max_pending = max_pending
        self._pending: dict[socket.socket, tuple[float, bytearray]] = {}  # oldest first; the loop's own
        self._app: _App = make_wsgi_app(registry)
        self.request_timeout = float(request_timeout)
        self.max_connections = max_connections
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            listener = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:
            raise MetricsServerError(f"cannot serve metrics on {_hostport(host, port)}: {e.strerror or e}; "
                                     "pick another --metrics-host") from None
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(max(64, 2 * max_connections))
            listener.setblocking(False)
        except OSError as e:
            listener.close()
            raise MetricsServerError(
                f"cannot serve metrics on {_hostport(host, port)}: {e.strerror or e}; "
                "pick another --metrics-port (0 picks a free one) or --metrics-host") from None
        self._listener = listener
        self.host = host
        self.port = int(listener.getsockname()[1])
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        # scrapes: requests whose head was read (numbered from 1), and the newest GET /metrics
        # whose 200 response the client acknowledged whole; :meth:`wait_for_scrape` waits on it
        self._requests = 0
        self._served = 0
        self._scraped = threading.Condition(self._lock)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._accept_loop, name=f"elastictk-metrics-{self.port}",
                                        daemon=True)
        self._thread.start()
        log.info("serving Prometheus metrics at %s", self.url)

    @property
    def url(self) -> str:
        return f"http://{_hostport(self.host, self.port)}/metrics"

    @property
    def target(self) -> str:
        """``host:port``, as a Prometheus scrape config names it."""
        return _hostport(self.host, self.port)

    @property
    def open_connections(self) -> int:
        """Responses being sent now (never more than ``max_connections``)."""
        with self._lock:
            return len(self._conns)

    @property
    def pending_connections(self) -> int:
        """Connections waiting for their whole request (never more than ``max_pending``)."""
        return len(self._pending)

    # -- accepting and reading requests (one thread, never blocking) ----------------------------
    def _accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        try:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._closed:
                soonest = min((d for d, _ in self._pending.values()), default=None)
                wait = None if soonest is None else max(0.0, soonest - time.monotonic())
                for key, _ in sel.select(wait):
                    if key.fileobj is self._listener:
                        self._accept_all(sel)
                    elif key.fileobj is not self._wake_r and isinstance(key.fileobj, socket.socket):
                        self._read(sel, key.fileobj)
                now = time.monotonic()
                for conn in [c for c, (d, _) in self._pending.items() if d <= now]:
                    log.debug("metrics http: dropped a client that sent no whole request within %gs",
                              self.request_timeout)
                    self._drop(sel, conn)
        finally:
            for conn in list(self._pending):
                self._drop(sel, conn)
            sel.close()

    def _drop(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _accept_all(self, sel: selectors.BaseSelector) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of fds, say: do not spin on a listener that stays readable
                log.debug("metrics http: accept failed: %s", e)
                time.sleep(0.05)
                return
            if len(self._pending) >= self.max_pending:
                oldest = next(iter(self._pending))
                log.debug("metrics http: %d clients wait for their request; closing the oldest", self.max_pending)
                self._drop(sel, oldest)
            conn.setblocking(False)
            self._pending[conn] = (time.monotonic() + self.request_timeout, bytearray())
            sel.register(conn, selectors.EVENT_READ)

    def _read(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        _, buf = self._pending[conn]
        try:
            chunk = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk or len(buf) + len(chunk) > MAX_REQUEST_BYTES:
            self._drop(sel, conn)  # gone, or more than a request head
            return
        buf += chunk
        if b"\r\n\r\n" not in buf and b"\n\n" not in buf:
            return
        self._pending.pop(conn)
        sel.unregister(conn)
        self._dispatch(conn, bytes(buf))

    def _dispatch(self, conn: socket.socket, head: bytes) -> None:
        """A whole request: a thread sends the response, or ``503`` at once when all are busy."""
        with self._lock:
            busy = self._closed or len(self._conns) >= self.max_connections
            if not busy:
                t = threading.Thread(target=self._serve, args=(conn, head), daemon=True,
                                     name=f"elastictk-metrics-{self.port}-conn")
                try:
                    t.start()  # under the lock: close() never sees a thread it cannot join
                except RuntimeError as e:  # no thread to be had
                    log.debug("metrics http: cannot start a request thread: %s", e)
                    busy = True
                else:
                    self._conns.add(conn)
                    # Ended threads leave the set here, not in their own finally: close() joins
                    # a thread that is past its cleanup but still running.
                    self._threads = {x for x in self._threads if x.is_alive()}
                    self._threads.add(t)
        if busy:
            log.debug("metrics http: %d responses in flight, answering 503", self.max_connections)
            try:
                conn.send(_response("503 Service Unavailable", [("Content-Type", "text/plain"),
                                                                ("Retry-After", "1")], b"busy\n"))
            except OSError:
                pass
            conn.close()

    # -- one response --------------------------------------------------------------------------
    def _serve(self, conn: socket.socket, head: bytes) -> None:
        try:
            with self._lock:
                self._requests += 1
                number = self._requests
            response = self._respond(head)
            conn.settimeout(self.request_timeout)  # the whole sendall, not each send (3.5+)
            sent_by = time.monotonic() + self.request_timeout
            conn.sendall(response)
            conn.shutdown(socket.SHUT_WR)
            if (is_scrape(head) and response.startswith(b"HTTP/1.1 200")
                    and self._delivered(conn, sent_by)):
                with self._scraped:
                    self._served = max(self._served, number)
                    self._scraped.notify_all()
        except OSError as e:  # a client gone, too slow to read, or shut down by close()
            log.debug("metrics http: connection dropped: %s", e)
        except Exception:  # noqa: BLE001 - a broken collector must not kill the server
            log.exception("metrics http: request failed")
        finally:
            with self._lock:  # removed before closing: close() shuts down only live sockets
                self._conns.discard(conn)
            conn.close()

    def _delivered(self, conn: socket.socket, deadline: float) -> bool:
        """Whether the client's side acknowledged every byte of the response and our FIN
        (``SIOCOUTQ`` drains to 0) without resetting the connection. ``sendall`` returns once
        the bytes are in our own buffer: a client that sent its request and hung up at once
        (its kernel answers the response with a reset) would count as a scrape that saw it."""
        pause = 0.0005
        while True:
            try:
                if conn.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    return False  # reset, or the peer is gone
                state = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
                unacked = struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ,
                                                         b"\0\0\0\0"))[0]
            except OSError:
                return False
            if unacked == 0:
                return True  # (a clean close after that also reads as TCP_CLOSE)
            if state == _TCP_CLOSE:
                return False  # closed with bytes unacknowledged: reset
            if self._closed or time.monotonic() >= deadline:
                return False
            time.sleep(pause)  # acks have no event to wait on; on loopback the first look sees them
            pause = min(pause * 2, 0.02)

    def _respond(self, head: bytes) -> bytes:
        lines = head.replace(b"\r\n", b"\n").split(b"\n\n", 1)[0].decode("latin-1").split("\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _response("400 Bad Request", [("Content-Type", "text/plain")], b"bad request\n")
        method, target, version = parts
        path, _, query = target.partition("?")
        environ: dict[str, Any] = {
            "REQUEST_METHOD": method, "PATH_INFO": unquote(path), "QUERY_STRING": query,
            "SERVER_PROTOCOL": version, "SERVER_NAME": self.host, "SERVER_PORT": str(self.port),
            "SCRIPT_NAME": "", "wsgi.input": io.BytesIO(), "wsgi.errors": sys.stderr,
            "wsgi.url_scheme": "http", "wsgi.version": (1, 0), "wsgi.multithread": True,
            "wsgi.multiprocess": False, "wsgi.run_once": False,
        }
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep and name.strip():
                environ["HTTP_" + name.strip().upper().replace("-", "_")] = value.strip()
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
            started[:] = [status, headers]

        body = b"".join(self._app(environ, start_response))
        status, headers = started
        log.debug("metrics http: %s %s -> %s", method, target, status)
        return _response(status, headers, b"" if method == "HEAD" else body)

    # -- scrapes -------------------------------------------------------------------------------
    @property
    def requests(self) -> int:
        """Requests read so far; pass it to :meth:`wait_for_scrape` to wait for a later one."""
        with self._lock:
            return self._requests

    def wait_for_scrape(self, after: int, timeout: float) -> bool:
        """Wait until a ``GET /metrics`` read after request number ``after`` has been answered
        whole with 200, every byte acknowledged by the client (so it saw every metric as it
        was when :attr:`requests` was ``after``), or ``timeout`` seconds pass; True if one was.
        A GET of another path, or a client gone before the answer reached it, is not one."""
        deadline = time.monotonic() + timeout
        with self._scraped:
            while self._served <= after:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return False
                self._scraped.wait(remaining)
            return True

    # -- shutting down -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop serving and release the threads and sockets, within about :data:`CLOSE_WAIT`
        seconds whatever clients do; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._scraped.notify_all()  # a wait_for_scrape ends: nothing more will be served
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        self._thread.join(CLOSE_WAIT)
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)  # wakes a recv or sendall blocked on it at once
                except OSError:
                    pass
            threads = list(self._threads)
        deadline = time.monotonic() + CLOSE_WAIT
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t for t in threads if t.is_alive()]
        if stuck:  # only a collector that hangs can get here; its daemon thread is left behind
            log.warning("metrics server on %s: %d request thread(s) still busy after close",
                        self.target, len(stuck))
        if not self._thread.is_alive():
            os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def is_scrape(head: bytes) -> bool:
    """A request head that is Prometheus's scrape: ``GET /metrics`` (a query string allowed).
    Only such a request, answered whole, ends ``--metrics-linger``: the app answers any path
    with the metrics, and a GET of another path is nobody's scrape."""
    first = head.split(b"\n", 1)[0].split()
    if len(first) != 3 or first[0] != b"GET":
        return False
    path = first[1].split(b"?", 1)[0]
    return unquote(path.decode("latin-1")) == "/metrics"


def _response(status: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    lines = [f"HTTP/1.1 {status}"]
    lines += [f"{k}: {v}" for k, v in headers if k.lower() not in ("content-length", "connection")]
    lines += [f"Content-Length: {len(body)}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

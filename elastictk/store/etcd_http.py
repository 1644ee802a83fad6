"""HTTP/JSON transport to etcd's v3 API (its gRPC-JSON gateway), with endpoint failover.

Why HTTP and not gRPC: etcd serves the same v3 API as JSON over plain HTTP/1.1 on its client
port, so elastictk talks to etcd with the standard library alone (no grpcio, no protobuf
stubs to keep in step with the server). Keys and values travel base64-encoded; int64 fields
come back as JSON strings and fields at their default value (0, false, empty) are left out.

One keep-alive connection serves the unary calls of a store object; a streaming call (watch)
gets a connection of its own, because its response never ends while the watch lives.

Failover: a call tries the endpoints in turn, starting from the last one that answered. A
connection that cannot be opened, a server that answers "unavailable" (no leader) or something
that is not etcd moves on to the next endpoint. A request that was already sent when its
connection broke is retried elsewhere only when repeating it is harmless (``retry_sent``), since
etcd may have applied it before the connection died.
"""
from __future__ import annotations

import base64
import http.client
import json
import select
import socket
import threading
from typing import Any, Sequence

from .base import Deadline, StoreClosed, StoreError, StoreUnreachable
from .endpoint import Endpoint

GRPC_CANCELED = 1
GRPC_NOT_FOUND = 5
GRPC_UNAVAILABLE = 14
HINT = (
    "check the etcd endpoint(s) (host:port of etcd's client port, default 2379) and that "
    "etcd is running there"
)
_HEADERS = {"Content-Type": "application/json", "Connection": "keep-alive"}

JSON = dict[str, Any]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


class EtcdApiError(StoreError):
    """etcd understood the request and refused it; ``code`` is the gRPC status code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class _Skip(Exception):
    """This endpoint cannot serve the call; try the next one.

    ``applied_maybe``: etcd may have applied the request anyway (e.g. "request timed out"),
    so a call that must not run twice cannot move on.
    """

    def __init__(self, why: str, applied_maybe: bool = False) -> None:
        super().__init__(why)
        self.why, self.applied_maybe = why, applied_maybe


def reason(exc: BaseException, timeout: float) -> str:
    """A short, human reason for a failed connection or request."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens there)"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"no answer within {timeout:.3g}s"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host ({exc.strerror})"
    if isinstance(exc, (http.client.RemoteDisconnected, http.client.BadStatusLine)):
        return "closed the connection without an HTTP answer (is it an etcd client port?)"
    if isinstance(exc, http.client.HTTPException):
        return f"broken HTTP answer ({type(exc).__name__}); is it an etcd client port?"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


def decode(endpoint: Endpoint, path: str, status: int, payload: bytes) -> JSON:
    """The JSON answer of a successful call; raises for etcd errors and non-etcd answers."""
    try:
        obj = json.loads(payload) if payload else {}
    except ValueError:
        obj = None
    if status == 200 and isinstance(obj, dict):
        return obj
    if isinstance(obj, dict) and "code" in obj and ("message" in obj or "error" in obj):
        code = int(obj["code"])
        message = str(obj.get("message") or obj.get("error"))
        if code == GRPC_CANCELED and "connection is closing" in message:
            # the member's gateway is shutting down: the request never reached etcd
            raise _Skip(f"etcd is shutting down ({message})")
        if code in (GRPC_UNAVAILABLE, GRPC_CANCELED):
            raise _Skip(f"etcd is unavailable ({message})", applied_maybe=True)
        raise EtcdApiError(f"etcd at {endpoint} refused {path}: {message}", code)
    raise _Skip(
        f"answered HTTP {status} to POST {path}, so it is not etcd 3.4+'s v3 API (an etcd "
        "peer port, default 2380, or another service?)"
    )


def _dropped(sock: socket.socket | None) -> bool:
    """Whether an idle keep-alive socket was closed by the server (it reads as ready)."""
    if sock is None:
        return True
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True


def _connect(endpoint: Endpoint, timeout: float) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=max(timeout, 0.001))
    conn.connect()
    assert conn.sock is not None
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


class JsonStream:
    """A streaming answer (watch): one JSON object per line, read with a timeout each."""

    def __init__(self, conn: http.client.HTTPConnection, sock: socket.socket,
                 response: http.client.HTTPResponse, endpoint: Endpoint) -> None:
        self._conn, self._sock, self._resp, self.endpoint = conn, sock, response, endpoint

    def next(self, timeout: float) -> JSON | None:
        """The next ``result``; ``None`` when the stream ended or broke.

        Raises :class:`TimeoutError` when nothing arrived within ``timeout``; the stream is
        unusable after that and must be closed.
        """
        self._sock.settimeout(max(timeout, 0.001))
        try:
            line = self._resp.readline()
        except TimeoutError:
            raise TimeoutError(f"no watch event within {timeout:.3g}s") from None
        except (OSError, http.client.HTTPException, ValueError):
            return None
        if not line.strip():
            return None
        try:
            obj = json.loads(line)
        except ValueError:
            return None
        result = obj.get("result") if isinstance(obj, dict) else None
        return result if isinstance(result, dict) else None

    def close(self) -> None:
        self._conn.close()
        try:
            self._sock.close()
        except OSError:
            pass


class EtcdTransport:
    """JSON calls to the first endpoint that answers; see the module docstring for failover."""

    def __init__(self, endpoints: Sequence[Endpoint], timeout: float) -> None:
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.requests = 0  # calls and streams opened, so tests can tell waiting from polling
        self._current = 0
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self._closed = False

    def describe(self) -> str:
        return "etcd://" + ",".join(str(e) for e in self.endpoints)

    def _order(self) -> list[int]:
        n = len(self.endpoints)
        return [(self._current + i) % n for i in range(n)]

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"{self.describe()} is closed")

    def _unreachable(self, failures: list[tuple[Endpoint, str]]) -> StoreUnreachable:
        if not failures:
            return StoreUnreachable(f"cannot reach etcd at {self.describe()}: out of time; {HINT}")
        shown = "; ".join(f"{ep}: {why}" for ep, why in failures)
        return StoreUnreachable(f"cannot reach etcd ({shown}); {HINT}")

    def call(self, path: str, body: JSON, *, timeout: float | None = None,
             retry_sent: bool = True) -> JSON:
        """POST ``body`` to ``path`` and return the decoded answer.

        ``retry_sent=False`` for calls that must not run twice (a counter increment): when
        such a request was sent and the connection broke before the answer, the call raises
        instead of trying the next endpoint.
        """
        data = json.dumps(body).encode()
        deadline = Deadline(self.timeout if timeout is None else timeout)
        failures: list[tuple[Endpoint, str]] = []
        with self._lock:
            self._check_open()
            order = self._order()
            for n_left, idx in zip(range(len(order), 0, -1), order):
                ep, left = self.endpoints[idx], deadline.remaining() or 0.0
                if left <= 0:
                    break
                if self._conn is not None and (idx != self._current or _dropped(self._conn.sock)):
                    self._drop()
                if self._conn is None:
                    try:
                        self._conn = _connect(ep, left / n_left)
                    except OSError as e:
                        failures.append((ep, reason(e, left / n_left)))
                        continue
                    self._current = idx
                conn = self._conn
                try:
                    assert conn.sock is not None
                    conn.sock.settimeout(max(deadline.remaining() or 0.0, 0.001))
                    conn.request("POST", path, body=data, headers=_HEADERS)
                    resp = conn.getresponse()
                    payload, status = resp.read(), resp.status
                except (OSError, http.client.HTTPException) as e:
                    self._drop()
                    why = reason(e, left)
                    if not retry_sent:
                        raise StoreUnreachable(
                            f"lost etcd at {ep} during {path} ({why}); the request may or may "
                            f"not have been applied; {HINT}"
                        ) from None
                    failures.append((ep, why))
                    continue
                if resp.will_close:
                    self._drop()
                self.requests += 1
                try:
                    return decode(ep, path, status, payload)
                except _Skip as e:
                    self._drop()
                    if not retry_sent and e.applied_maybe:
                        raise StoreUnreachable(
                            f"etcd at {ep} could not complete {path} ({e.why}); the request "
                            "may or may not have been applied"
                        ) from None
                    failures.append((ep, e.why))
            raise self._unreachable(failures)

    def stream(self, path: str, body: bytes, *, timeout: float) -> JsonStream:
        """Open a streaming call on a connection of its own (the first endpoint that answers)."""
        self._check_open()
        deadline = Deadline(timeout)
        failures: list[tuple[Endpoint, str]] = []
        order = self._order()
        for n_left, idx in zip(range(len(order), 0, -1), order):
            ep, left = self.endpoints[idx], deadline.remaining() or 0.0
            if left <= 0:
                break
            conn: http.client.HTTPConnection | None = None
            try:
                conn = _connect(ep, left / n_left)
                sock = conn.sock
                assert sock is not None
                sock.settimeout(max(deadline.remaining() or 0.0, 0.001))
                conn.request("POST", path, body=body, headers=_HEADERS)
                resp = conn.getresponse()
                if resp.status != 200:
                    decode(ep, path, resp.status, resp.read())
                    raise _Skip(f"answered HTTP {resp.status} to POST {path}")
            except (OSError, http.client.HTTPException) as e:
                if conn is not None:
                    conn.close()
                failures.append((ep, reason(e, left)))
                continue
            except _Skip as e:
                if conn is not None:
                    conn.close()
                failures.append((ep, e.why))
                continue
            except BaseException:
                if conn is not None:
                    conn.close()
                raise
            self._current = idx
            self.requests += 1
            return JsonStream(conn, sock, resp, ep)
        raise self._unreachable(failures)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()

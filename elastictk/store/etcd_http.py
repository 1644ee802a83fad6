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

TLS: with an :class:`ssl.SSLContext` every connection is HTTPS (the context verifies etcd's
certificate against the CA and presents the client certificate). A TLS failure (wrong CA, no or
a foreign client certificate, plain HTTP to a TLS port or the reverse) is named with its fix,
since retrying cannot cure it.
"""
from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import threading
from typing import Any, Sequence

from .base import Deadline, StoreClosed, StoreError, StoreUnreachable
from .endpoint import Endpoint
from ..lifetime.ready import readable
from .etcd_diagnose import (  # noqa: F401 - speaks_tls and TLS_HINT re-exported
    TLS_HINT, NoAnswer, TLSProblem, explain, reason, speaks_tls,
)

GRPC_CANCELED = 1
GRPC_NOT_FOUND = 5
GRPC_UNAVAILABLE = 14
HINT = (
    "check the etcd endpoint(s) (host:port of etcd's client port, default 2379) and that "
    "etcd is running there"
)
_HEADERS = {"Content-Type": "application/json", "Connection": "keep-alive"}
#: what Go's HTTP server answers to plain HTTP on a TLS port (etcd with --cert-file)
_PLAIN_TO_TLS = b"HTTP request to an HTTPS server"

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


#: OpenSSL's names for the alerts a server sends when it refuses the client's certificate
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
    if _PLAIN_TO_TLS in payload:
        raise _Skip(TLSProblem(
            "it serves TLS and was spoken to in plain HTTP: use https://host:port endpoints (or "
            "--rdzv-conf protocol=https) with cacert=, cert= and key="
        ))
    raise _Skip(
        f"answered HTTP {status} to POST {path}, so it is not etcd 3.4+'s v3 API (an etcd "
        "peer port, default 2380, or another service?)"
    )


def _dropped(sock: socket.socket | None) -> bool:
    """Whether an idle keep-alive socket was closed by the server (it reads as ready)."""
    if sock is None:
        return True
    try:
        return bool(readable([sock], 0))
    except (OSError, ValueError):
        return True


def _connect(endpoint: Endpoint, timeout: float,
             tls: ssl.SSLContext | None = None) -> http.client.HTTPConnection:
    """A connection to ``endpoint``, over TLS (handshake done here) when ``tls`` is given."""
    t = max(timeout, 0.001)
    conn = (http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=t) if tls is None
            else http.client.HTTPSConnection(endpoint.host, endpoint.port, timeout=t, context=tls))
    try:
        conn.connect()
    except BaseException:
        conn.close()
        raise
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

    def ready(self, timeout: float) -> bool:
        """Whether an answer has (begun to) come within ``timeout``, without consuming it, so a
        waiter can look at a stop flag between short slices and keep the stream usable (a
        read that times out leaves it broken). Bytes already buffered count as ready."""
        try:
            self._sock.settimeout(0.0)  # a non-blocking look: what is buffered, or nothing
            try:
                buffered = self._resp.fp.peek(1) if self._resp.fp is not None else b""
                if self._resp.chunk_left == 0:  # the chunk's closing CRLF is not a line
                    buffered = buffered[2:]
                if buffered:
                    return True
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                pass
            finally:
                self._sock.settimeout(None)
        except (OSError, ValueError, http.client.HTTPException):
            return True  # broken: let next() say so
        return bool(readable([self._sock], max(timeout, 0.0)))

    def close(self) -> None:
        self._conn.close()
        try:
            self._sock.close()
        except OSError:
            pass


class EtcdTransport:
    """JSON calls to the first endpoint that answers; see the module docstring for failover."""

    def __init__(self, endpoints: Sequence[Endpoint], timeout: float,
                 tls: ssl.SSLContext | None = None) -> None:
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.tls = tls
        self.requests = 0  # calls and streams opened, so tests can tell waiting from polling
        self._current = 0
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self._closed = False

    def describe(self) -> str:
        scheme = "etcd" if self.tls is None else "etcd+https"
        return f"{scheme}://" + ",".join(str(e) for e in self.endpoints)

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
            e = StoreUnreachable(f"cannot reach etcd at {self.describe()}: out of time; {HINT}")
        elif all(isinstance(why, TLSProblem) for _, why in failures):  # each says its own fix
            shown = "; ".join(f"{ep}: {why}" for ep, why in failures)
            e = StoreUnreachable(f"cannot talk to etcd over {self.describe()} ({shown})")
        else:
            shown = "; ".join(f"{ep}: {why}" for ep, why in failures)
            e = StoreUnreachable(f"cannot reach etcd ({shown}); {HINT}")
        # Only slowness (no endpoint refused, none spoke something else): a caller whose own
        # deadline has passed meanwhile reports a timeout, not a lost store.
        setattr(e, "no_answer", all(isinstance(why, NoAnswer) for _, why in failures))
        return e

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
                        self._conn = _connect(ep, left / n_left, self.tls)
                    except OSError as e:
                        failures.append((ep, explain(e, ep, left / n_left, self.tls)))
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
                    why = explain(e, ep, left, self.tls)
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
                conn = _connect(ep, left / n_left, self.tls)
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
                failures.append((ep, explain(e, ep, left, self.tls)))
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

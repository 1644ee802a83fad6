"""The peer tier's transport: a small TCP server in each agent, and the client other agents use.

The server listens on the agent's own address (port 0; the port travels in the agent's sealed
join record) and answers three requests over authenticated connections (:mod:`.wire`):

- ``put``: a part of another node (origin, rank, world, step, checksum, length, then the raw
  bytes), received straight into a replica's memory and kept only if its checksum matches;
- ``index``: what replicas this agent holds;
- ``get``: one replica's bytes, which the client checks against the checksum before use.

Every field of every message is checked by :mod:`.messages` before use. Refusals (a stranger,
a malformed message, a torn part, no room) are logged in one line, at most once a minute per
cause and peer; the connection is closed, the agent goes on.
"""
from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from typing import Callable, Optional

from . import messages
from .codec import checksum
from .handshake import greet, introduce
from .ratelog import RateLimitedLog
from .replicas import Key, NoRoom, Replicas
from .wire import CHUNK, MAX_HEADER, Late, Refused, WireError, recv, recv_into, send

log = logging.getLogger("elastictk.snapshot")
TIMEOUT = 60.0  # an authenticated peer silent for this long is gone
HANDSHAKE_TIMEOUT = 5.0  # the whole handshake, however the bytes trickle in
MAX_PENDING = 16  # connections still in the handshake; a new one past this closes the oldest
MAX_PEERS = 64  # authenticated connections; one past this is closed at once
MAX_REQUEST = 4096  # a request header is ~150 bytes
FD_BACKOFF = 0.1  # out of file descriptors: seconds before accepting again
OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class PeerServer:
    """Serves this agent's replicas on ``host`` (port 0).

    Strangers cannot starve it: a connection has ``handshake_timeout`` seconds for the whole
    handshake and :data:`~.handshake.MAX_HELLO` bytes per header until then; at most
    ``max_pending`` connections are in the handshake at once (a new one closes the oldest, whose
    deadline is nearest, so a flood of idle connections cannot keep an honest peer out for
    longer than its own handshake takes) and at most ``max_peers`` authenticated ones are served
    (past that a connection is closed at once). Running out of file descriptors pauses accepting
    for :data:`FD_BACKOFF` seconds, never ends it. Every error a connection raises ends that
    connection only and is logged in one line, at most once a minute per cause.
    """

    def __init__(self, host: str, replicas: Replicas, key: Optional[bytes], job: str,
                 on_kept: Optional[Callable[[Key, list[Key]], None]] = None, *,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT, max_pending: int = MAX_PENDING,
                 max_peers: int = MAX_PEERS) -> None:
        self.replicas, self.key, self.job, self.on_kept = replicas, key, job, on_kept
        self.handshake_timeout, self.max_pending, self.max_peers = handshake_timeout, max_pending, max_peers
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._pending: dict[socket.socket, str] = {}  # in the handshake, oldest first -> address
        self._peers: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._log = RateLimitedLog(log, "snapshot peer tier")
        self._accepting = threading.Thread(target=self._accept, name="elastictk-peer-accept", daemon=True)
        self._accepting.start()

    def _warn(self, cause: str, line: str) -> None:
        self._log.warn(cause, line)

    def connections(self) -> tuple[int, int]:
        """(in the handshake, authenticated) connections open now."""
        with self._lock:
            return len(self._pending), len(self._peers)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError as e:
                if self._closed:
                    return
                if e.errno in (errno.ECONNABORTED, errno.EINTR, errno.EPROTO):
                    continue
                why = ("out of file descriptors" if e.errno in OUT_OF_FDS else "accept failed")
                self._warn(f"accept {e.errno}", f"{why} ({e.strerror or e}); accepting again in "
                           f"{FD_BACKOFF:g} s")
                self._stop.wait(FD_BACKOFF)
                continue
            self._admit(conn, str(addr[0]))

    def _admit(self, conn: socket.socket, who: str) -> None:
        evicted: Optional[str] = None
        with self._lock:
            if self._closed:
                conn.close()
                return
            if len(self._pending) >= self.max_pending:
                oldest = next(iter(self._pending))
                evicted = self._pending.pop(oldest)
                try:
                    oldest.shutdown(socket.SHUT_RDWR)  # its thread wakes, closes it and ends
                except OSError:
                    pass
            # Ended threads leave the set here, not in their own finally: one that discarded itself
            # there still ran its last lines, and close() returned before it ended.
            self._threads = {x for x in self._threads if x.is_alive()}
            t = threading.Thread(target=self._serve, args=(conn, who), name="elastictk-peer-conn", daemon=True)
            try:
                t.start()  # under the lock: close() never misses a thread it must join
            except RuntimeError as e:  # no thread to be had: this connection is dropped
                conn.close()
                self._warn("thread", f"cannot start a thread for a connection from {who}: {e}")
                return
            self._pending[conn] = who
            self._threads.add(t)
        if evicted is not None:
            self._warn("evicted", f"{self.max_pending} connections in the handshake: closed the oldest, "
                       f"from {evicted}, for a new one from {who}")

    def _serve(self, conn: socket.socket, who: str) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.handshake_timeout)
            greet(conn, self.key, self.job, time.monotonic() + self.handshake_timeout)
            with self._lock:
                if self._pending.pop(conn, None) is None:  # evicted or closing meanwhile
                    return
                full = len(self._peers) >= self.max_peers
                if not full:
                    self._peers.add(conn)
            if full:
                self._warn("full", f"{self.max_peers} authenticated connections open: closed a new one "
                           f"from {who}")
                return
            conn.settimeout(TIMEOUT)
            while True:
                self._request(conn, recv(conn, MAX_REQUEST), who)
        except Refused as e:
            self._warn(f"refused {who}", f"refused a connection from {who}: {e}")
        except Late as e:
            self._warn("late", f"closed a connection from {who} that did not finish the handshake "
                       f"within {self.handshake_timeout:g} s ({e})")
        except messages.BadMessage as e:
            self._warn(f"bad {who}", f"refused a message from {who}: {e}")
        except (WireError, OSError) as e:
            if not self._closed and not (isinstance(e, WireError) and "after 0 of" in str(e)):
                self._warn(f"{type(e).__name__} {who}", f"connection from {who} ended: {e}")
        except Exception as e:  # noqa: BLE001 - whatever a peer sends ends its connection only
            self._warn(f"{type(e).__name__} {who}", f"connection from {who} ended: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._pending.pop(conn, None)
                self._peers.discard(conn)
            conn.close()

    def _request(self, conn: socket.socket, req: dict[str, object], who: str) -> None:
        try:
            op = messages.op(req)
            if op == "put":
                self._put(conn, messages.put_request(req), who)
            elif op == "index":
                send(conn, {"ok": True, "replicas": [k.__dict__ for k in self.replicas.index()]})
            else:
                self._get(conn, *messages.get_request(req))
        except messages.BadMessage as e:
            send(conn, {"ok": False, "why": f"bad request: {e}"})
            raise

    def _put(self, conn: socket.socket, req: messages.Put, who: str) -> None:
        key, nbytes, digest = req.key, req.nbytes, req.digest
        try:
            rep = self.replicas.reserve(key, digest, nbytes)
        except (NoRoom, OSError) as e:
            self._warn(f"noroom {key.rank}", str(e))
            send(conn, {"ok": False, "why": str(e)})
            return
        send(conn, {"ok": True})
        try:
            recv_into(conn, rep.data())
            got = checksum(rep.data())
        except BaseException:
            self.replicas.discard(rep)
            raise
        if got != digest:
            self.replicas.discard(rep)
            why = (f"rank {key.rank}'s part of step {key.step} from {who} is torn (checksum "
                   f"{got:016x} != {digest:016x}); not kept")
            self._warn(f"torn {who}", why)
            send(conn, {"ok": False, "why": why})
            return
        gone = self.replicas.keep(rep)
        if self.on_kept is not None:
            self.on_kept(key, gone)
        send(conn, {"ok": True})

    def _get(self, conn: socket.socket, rank: int, world: int, step: int) -> None:
        rep = self.replicas.borrow(rank, world, step)
        if rep is None:
            send(conn, {"ok": False, "why": "no such replica here"})
            return
        try:
            send(conn, {"ok": True, "nbytes": rep.length, "sum": rep.digest, "origin": rep.key.origin},
                 rep.data())
        finally:
            self.replicas.give_back(rep)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, threads = [*self._pending, *self._peers], list(self._threads)
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accepting.join(timeout=5)
        for t in threads:
            t.join(timeout=5)


class PeerClient:
    """One authenticated connection to another agent's :class:`PeerServer`."""

    def __init__(self, host: str, port: int, key: Optional[bytes], job: str, timeout: float = TIMEOUT) -> None:
        self.where = f"{host}:{port}"
        self.sock = socket.create_connection((host, port), timeout=timeout)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            introduce(self.sock, key, job)
        except BaseException:
            self.sock.close()
            raise

    def put(self, origin: str, rank: int, world: int, step: int, digest: int, data: memoryview) -> None:
        """Send one part; :class:`WireError` naming why if the peer did not keep it."""
        send(self.sock, {"op": "put", "origin": origin, "rank": rank, "world": world, "step": step,
                         "nbytes": len(data), "sum": digest})
        go = messages.answer(recv(self.sock))
        if not go.ok:
            raise WireError(f"{self.where} refused rank {rank}'s step {step}: {go.why}")
        for start in range(0, len(data), CHUNK):
            self.sock.sendall(data[start:start + CHUNK])
        done = messages.answer(recv(self.sock))
        if not done.ok:
            raise WireError(f"{self.where} did not keep rank {rank}'s step {step}: {done.why}")

    def index(self) -> list[Key]:
        send(self.sock, {"op": "index"})
        return messages.index_reply(recv(self.sock, MAX_HEADER))

    def get(self, rank: int, world: int, step: int, limit: int = messages.MAX_PART) -> tuple[bytearray, int]:
        """The bytes of a replica and their checksum, verified; :class:`WireError` if absent,
        torn, or announced larger than ``limit`` bytes (nothing is allocated for it then)."""
        send(self.sock, {"op": "get", "rank": rank, "world": world, "step": step})
        head = recv(self.sock)
        answer = messages.answer(head)
        if not answer.ok:
            raise WireError(f"{self.where} has no rank {rank}'s step {step}: {answer.why}")
        part = messages.get_reply(head, limit)
        buf = bytearray(part.nbytes)
        recv_into(self.sock, memoryview(buf))
        digest = part.digest
        got = checksum(buf)
        if got != digest:
            raise WireError(f"rank {rank}'s part of step {step} from {self.where} is torn "
                            f"(checksum {got:016x} != {digest:016x})")
        return buf, digest

    def close(self) -> None:
        self.sock.close()

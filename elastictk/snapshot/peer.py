"""The peer tier's transport: a small TCP server in each agent, and the client other agents use.

The server listens on the agent's own address (port 0; the port travels in the agent's sealed
join record) and answers three requests over authenticated connections (:mod:`.wire`):

- ``put``: a part of another node (origin, rank, world, step, checksum, length, then the raw
  bytes), received straight into a replica's memory and kept only if its checksum matches;
- ``index``: what replicas this agent holds, and which steps it holds in its own local slots
  (``local``: what a round's start agrees on before anything is fetched, :mod:`.ring`);
- ``get``: one replica's bytes, which the client checks against the checksum before use.

Every field of every message is checked by :mod:`.messages` before use. Refusals (a stranger,
a malformed message, a torn part, no room) are logged in one line, at most once a minute per
cause and peer; the connection is closed, the agent goes on.

A peer that holds the token is still held to limits, per peer (one sender address) and in
all: authenticated connections (:data:`MAX_PEER_CONNECTIONS` of :data:`MAX_PEERS`), replicas
and bytes still arriving (:mod:`.replicas`), and time: a put's bytes must arrive by
:func:`~.wire.payload_deadline` (:data:`PUT_FLOOR` plus the bytes at
:data:`~.wire.MIN_RATE`), a ``get``'s bytes must be read by the same. The client holds a
server to the same: connect and handshake, each header and each payload within its
deadline, so a server that trickles its replies cannot hold an agent's round start.
"""
from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import threading
import time
from typing import Any, Callable, Optional

from . import messages
from .codec import checksum
from .handshake import greet, introduce
from .ratelog import RateLimitedLog
from .replicas import Key, NoRoom, Replicas
from .settings import human
from .wire import (
    MAX_HEADER, MIN_RATE, Late, Refused, WireError, payload_deadline, recv, recv_into, send, send_payload,
)

log = logging.getLogger("elastictk.snapshot")
TIMEOUT = 60.0  # an authenticated peer silent for this long is gone
HANDSHAKE_TIMEOUT = 5.0  # the whole handshake, however the bytes trickle in
MAX_PENDING = 16  # connections still in the handshake; a new one past this closes the oldest
MAX_PEERS = 64  # authenticated connections; one past this is closed at once
MAX_PEER_CONNECTIONS = 16  # ... of them from one address (a node needs 1 per ring neighbour + 1)
PUT_FLOOR = 30.0  # seconds a part's bytes may take on top of their size at wire.MIN_RATE
MAX_REQUEST = 4096  # a request header is ~150 bytes
FD_BACKOFF = 0.1  # out of file descriptors: seconds before accepting again
FD_RESERVE = 128  # descriptors a connection never takes from the agent (a quarter of a lower limit)
OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class PeerServer:
    """Serves this agent's replicas on ``host`` (port 0).

    Strangers cannot starve it: a connection has ``handshake_timeout`` seconds for the whole
    handshake and :data:`~.handshake.MAX_HELLO` bytes per header until then; at most
    ``max_pending`` connections are in the handshake at once (a new one closes the oldest, whose
    deadline is nearest, so a flood of idle connections cannot keep an honest peer out for
    longer than its own handshake takes) and at most ``max_peers`` authenticated ones are served
    (past that a connection is closed at once), at most ``max_peer_connections`` of them from one
    address. No connection is accepted while the agent has :data:`FD_RESERVE` descriptors or
    fewer left (a quarter of a lower limit): they wait in the listen backlog, as they do when
    the agent runs out of them anyway; either pauses accepting for :data:`FD_BACKOFF` seconds,
    never ends it. Every error a connection raises ends that
    connection only and is logged in one line, at most once a minute per cause.
    """

    def __init__(self, host: str, replicas: Replicas, key: Optional[bytes], job: str,
                 on_kept: Optional[Callable[[Key, list[Key]], None]] = None,
                 local: Optional[Callable[[], list[dict[str, Any]]]] = None, *,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT, max_pending: int = MAX_PENDING,
                 max_peers: int = MAX_PEERS, max_peer_connections: int = MAX_PEER_CONNECTIONS,
                 put_floor: float = PUT_FLOOR) -> None:
        self.replicas, self.key, self.job, self.on_kept, self.local = replicas, key, job, on_kept, local
        self.handshake_timeout, self.max_pending, self.max_peers = handshake_timeout, max_pending, max_peers
        self.max_peer_connections, self.put_floor = max_peer_connections, put_floor
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._pending: dict[socket.socket, str] = {}  # in the handshake, oldest first -> address
        self._peers: dict[socket.socket, str] = {}  # authenticated -> address
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self.whole = self.torn = 0  # parts that arrived and were kept / refused by their checksum
        self._log = RateLimitedLog(log, "snapshot peer tier")
        self._accepting = threading.Thread(target=self._accept, name="elastictk-peer-accept", daemon=True)
        self._accepting.start()

    def _warn(self, cause: str, line: str) -> None:
        self._log.warn(cause, line)

    def connections(self) -> tuple[int, int]:
        """(in the handshake, authenticated) connections open now (their descriptors too)."""
        with self._lock:
            return len(self._pending), len(self._peers)

    def _accept(self) -> None:
        while not self._closed:
            left, reserve = fds_left()
            if left <= reserve:  # leave them to the agent; connections wait in the listen backlog
                self._warn("reserve", f"the agent has {left} file descriptors left: not accepting "
                           f"connections for {FD_BACKOFF:g} s (the peer tier leaves {reserve} to the "
                           "workers, the stores and /proc); raise the open-file limit (ulimit -n)")
                self._stop.wait(FD_BACKOFF)
                continue
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
                full = self._full(who)
                if full is None:
                    self._peers[conn] = who
            if full is not None:
                self._warn(f"full {who}", f"{full}: closed a new one from {who}")
                return
            conn.settimeout(TIMEOUT)
            while True:
                self._request(conn, recv(conn, MAX_REQUEST), who)
        except Refused as e:
            self._warn(f"refused {who}", f"refused a connection from {who}: {e}")
        except Late as e:
            if conn in self._peers:
                self._warn(f"late {who}", f"closed a connection from {who}: {e}")
            else:
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
            # Closed as it leaves the sets, in one step under the lock: connections() never
            # counts a connection whose peer already saw it closed, nor misses one whose
            # descriptor is still open (a TCP close without SO_LINGER does not block).
            with self._lock:
                self._pending.pop(conn, None)
                self._peers.pop(conn, None)
                conn.close()

    def _full(self, who: str) -> Optional[str]:
        """Why an authenticated connection from ``who`` may not be served now (None: it may).
        Under the lock."""
        if len(self._peers) >= self.max_peers:
            return f"{self.max_peers} authenticated connections open"
        if sum(1 for w in self._peers.values() if w == who) >= self.max_peer_connections:
            return f"{self.max_peer_connections} authenticated connections from {who} open (the most one peer may)"
        return None

    def _request(self, conn: socket.socket, req: dict[str, object], who: str) -> None:
        try:
            op = messages.op(req)
            if op == "put":
                self._put(conn, messages.put_request(req), who)
            elif op == "index":
                send(conn, {"ok": True, "replicas": [k.__dict__ for k in self.replicas.index()],
                            "local": self.local() if self.local is not None else []},
                     deadline=time.monotonic() + self.put_floor)
            else:
                self._get(conn, *messages.get_request(req))
            conn.settimeout(TIMEOUT)  # a deadline above changed it
        except messages.BadMessage as e:
            send(conn, {"ok": False, "why": f"bad request: {e}"})
            raise

    def _put(self, conn: socket.socket, req: messages.Put, who: str) -> None:
        key, nbytes, digest = req.key, req.nbytes, req.digest
        try:
            rep = self.replicas.reserve(key, digest, nbytes, who)
        except (NoRoom, OSError) as e:
            self._warn(f"noroom {who}", str(e))  # per peer: ranks are the sender's to choose
            send(conn, {"ok": False, "why": str(e)})
            return
        send(conn, {"ok": True})
        t0 = time.monotonic()
        try:
            recv_into(conn, rep.data(), payload_deadline(nbytes, self.put_floor))
            got = checksum(rep.data())
        except Late as e:
            self.replicas.discard(rep)
            allowed = time.monotonic() - t0
            raise Late(f"a part of {human(nbytes)} did not arrive in time ({e}, {allowed:.1f} s: "
                       f"{self.put_floor:g} s plus its size at {human(MIN_RATE)}/s); its reservation "
                       "is freed") from None
        except BaseException:
            self.replicas.discard(rep)
            raise
        if got != digest:
            self.replicas.discard(rep)
            why = (f"rank {key.rank}'s part of step {key.step} from {who} is torn (checksum "
                   f"{got:016x} != {digest:016x}); not kept")
            self.torn += 1
            self._warn(f"torn {who}", why)
            send(conn, {"ok": False, "why": why})
            return
        gone = self.replicas.keep(rep)
        self.whole += 1
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
                 rep.data(), payload_deadline(rep.length, self.put_floor))
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


def fds_left() -> tuple[int, int]:
    """(descriptors this process may still open, how many of them a peer connection must leave):
    the soft ``RLIMIT_NOFILE`` less those open now; :data:`FD_RESERVE`, or a quarter of a lower
    limit. The peer tier is the one part of the agent whose descriptors others make it open, so
    it alone checks: a token holder cannot bring the agent to ``EMFILE``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 30, FD_RESERVE
    reserve = min(FD_RESERVE, soft // 4)
    try:
        return soft - len(os.listdir("/proc/self/fd")) + 1, reserve  # + the listing's own
    except OSError:
        return 0, reserve


class PeerClient:
    """One authenticated connection to another agent's :class:`PeerServer`.

    ``timeout`` is a deadline, not a per-call timeout: connect and handshake together, then each
    request's headers, must be done within it; a payload within it plus its size at
    :data:`~.wire.MIN_RATE`. A server that trickles its bytes is :class:`~.wire.Late`, never a
    hang (an agent's round start waits for its peers' ``index`` and ``get``)."""

    def __init__(self, host: str, port: int, key: Optional[bytes], job: str, timeout: float = TIMEOUT) -> None:
        self.where, self.timeout = f"{host}:{port}", timeout
        deadline = time.monotonic() + timeout
        self.sock = socket.create_connection((host, port), timeout=timeout)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            introduce(self.sock, key, job, deadline)
        except BaseException:
            self.sock.close()
            raise

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout

    def put(self, origin: str, rank: int, world: int, step: int, digest: int, data: memoryview) -> None:
        """Send one part; :class:`WireError` naming why if the peer did not keep it."""
        send(self.sock, {"op": "put", "origin": origin, "rank": rank, "world": world, "step": step,
                         "nbytes": len(data), "sum": digest}, deadline=self._deadline())
        go = messages.answer(recv(self.sock, deadline=self._deadline()))
        if not go.ok:
            raise WireError(f"{self.where} refused rank {rank}'s step {step}: {go.why}")
        finish = payload_deadline(len(data), self.timeout)
        send_payload(self.sock, data, finish)
        done = messages.answer(recv(self.sock, deadline=finish + self.timeout))  # it checksums first
        if not done.ok:
            raise WireError(f"{self.where} did not keep rank {rank}'s step {step}: {done.why}")

    def index(self) -> list[Key]:
        return self.holdings()[0]

    def holdings(self) -> tuple[list[Key], list[messages.Held]]:
        """The replicas the peer holds, and the steps it holds in its own local slots."""
        send(self.sock, {"op": "index"}, deadline=self._deadline())
        reply = recv(self.sock, MAX_HEADER, self._deadline())
        return messages.index_reply(reply), messages.index_local(reply)

    def get(self, rank: int, world: int, step: int, limit: int = messages.MAX_PART) -> tuple[bytearray, int]:
        """The bytes of a replica and their checksum, verified; :class:`WireError` if absent,
        torn, or announced larger than ``limit`` bytes (nothing is allocated for it then)."""
        send(self.sock, {"op": "get", "rank": rank, "world": world, "step": step}, deadline=self._deadline())
        head = recv(self.sock, deadline=self._deadline())
        answer = messages.answer(head)
        if not answer.ok:
            raise WireError(f"{self.where} has no rank {rank}'s step {step}: {answer.why}")
        part = messages.get_reply(head, limit)
        buf = bytearray(part.nbytes)
        recv_into(self.sock, memoryview(buf), payload_deadline(part.nbytes, self.timeout))
        digest = part.digest
        got = checksum(buf)
        if got != digest:
            raise WireError(f"rank {rank}'s part of step {step} from {self.where} is torn "
                            f"(checksum {got:016x} != {digest:016x})")
        return buf, digest

    def close(self) -> None:
        self.sock.close()

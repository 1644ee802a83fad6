"""The peer tier's transport: a small TCP server in each agent, and the client other agents use.

The server listens on the agent's own address (port 0; the port travels in the agent's sealed
join record) and answers three requests over authenticated connections (:mod:`.wire`):

- ``put``: a part of another node (origin, rank, world, step, checksum, length, then the raw
  bytes), received straight into a replica's memory and kept only if its checksum matches;
- ``index``: what replicas this agent holds;
- ``get``: one replica's bytes, which the client checks against the checksum before use.

Refusals (a stranger, a torn part, no room) are logged once per cause and peer; the connection
is closed, the agent goes on.
"""
from __future__ import annotations

import logging
import socket
import threading
from typing import Any, Callable, Optional

from .codec import checksum
from .replicas import Key, NoRoom, Replicas
from .wire import CHUNK, Refused, WireError, greet, introduce, recv, recv_into, send

log = logging.getLogger("elastictk.snapshot")
TIMEOUT = 60.0  # no byte for this long: the peer is gone


class PeerServer:
    """Serves this agent's replicas on ``host`` (port 0)."""

    def __init__(self, host: str, replicas: Replicas, key: Optional[bytes], job: str,
                 on_kept: Optional[Callable[[Key, list[Key]], None]] = None) -> None:
        self.replicas, self.key, self.job, self.on_kept = replicas, key, job, on_kept
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(16)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._warned: set[str] = set()
        self._accepting = threading.Thread(target=self._accept, name="elastictk-peer-accept", daemon=True)
        self._accepting.start()

    def _warn(self, cause: str, line: str) -> None:
        if cause not in self._warned:
            self._warned.add(cause)
            log.warning("snapshot peer tier: %s", line)

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
                t = threading.Thread(target=self._serve, args=(conn, addr[0]), name="elastictk-peer-conn",
                                     daemon=True)
                self._threads.add(t)
            t.start()

    def _serve(self, conn: socket.socket, who: str) -> None:
        try:
            conn.settimeout(TIMEOUT)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            greet(conn, self.key, self.job)
            while True:
                req = recv(conn)
                op = req.get("op")
                if op == "put":
                    self._put(conn, req, who)
                elif op == "index":
                    send(conn, {"ok": True, "replicas": [k.__dict__ for k in self.replicas.index()]})
                elif op == "get":
                    self._get(conn, req)
                else:
                    raise WireError(f"unknown request {op!r}")
        except Refused as e:
            self._warn(f"refused {who}", f"refused a connection from {who}: {e}")
        except (WireError, OSError, ValueError, TypeError, KeyError) as e:
            if not self._closed and not (isinstance(e, WireError) and "after 0 of" in str(e)):
                self._warn(f"{type(e).__name__} {who}", f"connection from {who} ended: {e}")
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()

    def _put(self, conn: socket.socket, req: dict[str, Any], who: str) -> None:
        key = Key(str(req["origin"]), int(req["rank"]), int(req["world"]), int(req["step"]))
        nbytes, digest = int(req["nbytes"]), int(req["sum"])
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

    def _get(self, conn: socket.socket, req: dict[str, Any]) -> None:
        rep = self.replicas.borrow(int(req["rank"]), int(req["world"]), int(req["step"]))
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
            conns, threads = list(self._conns), list(self._threads)
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
        go = recv(self.sock)
        if not go.get("ok"):
            raise WireError(f"{self.where} refused rank {rank}'s step {step}: {go.get('why')}")
        for start in range(0, len(data), CHUNK):
            self.sock.sendall(data[start:start + CHUNK])
        done = recv(self.sock)
        if not done.get("ok"):
            raise WireError(f"{self.where} did not keep rank {rank}'s step {step}: {done.get('why')}")

    def index(self) -> list[Key]:
        send(self.sock, {"op": "index"})
        reply = recv(self.sock)
        return [Key(str(r["origin"]), int(r["rank"]), int(r["world"]), int(r["step"]))
                for r in reply.get("replicas", [])]

    def get(self, rank: int, world: int, step: int) -> tuple[bytearray, int]:
        """The bytes of a replica and their checksum, verified; :class:`WireError` if absent or torn."""
        send(self.sock, {"op": "get", "rank": rank, "world": world, "step": step})
        head = recv(self.sock)
        if not head.get("ok"):
            raise WireError(f"{self.where} has no rank {rank}'s step {step}: {head.get('why')}")
        buf = bytearray(int(head["nbytes"]))
        recv_into(self.sock, memoryview(buf))
        digest = int(head["sum"])
        got = checksum(buf)
        if got != digest:
            raise WireError(f"rank {rank}'s part of step {step} from {self.where} is torn "
                            f"(checksum {got:016x} != {digest:016x})")
        return buf, digest

    def close(self) -> None:
        self.sock.close()

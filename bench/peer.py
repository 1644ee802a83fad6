"""The peer snapshot tier's transport against raw loopback TCP: MB/s sending one part.

elastictk: one 100 MB part (10 MB in quick mode) sent agent to agent as the peer tier sends
it (:class:`~elastictk.snapshot.peer.PeerClient` ``put`` to a :class:`~elastictk.snapshot.peer.PeerServer`
over an authenticated connection: a JSON header, the raw bytes received straight into a
replica's memfd, the checksum verified before the replica is kept, the reply). Reference: the
same bytes over a plain loopback socket (``sendall`` into ``recv_into`` of a preallocated
buffer, no header, no checksum). A sample is the throughput of one transfer, in MB/s; the
handshake is outside the timing in both (one connection per run, as an agent keeps one per
neighbour).
"""
from __future__ import annotations

import os
import socket
import threading
import time

from elastictk.snapshot.codec import checksum
from elastictk.snapshot.peer import PeerClient, PeerServer
from elastictk.snapshot.replicas import Replicas

from .common import BenchResult, Comparison, Measured, RunConfig, interleaved

TITLE = "Peer snapshot tier: one part sent agent to agent vs raw loopback TCP (MB/s)"
MB = 10**6
TOKEN, JOB = b"bench-token", "bench"


class _Raw:
    """A plain loopback sink: reads exactly n bytes into one buffer, then acknowledges."""

    def __init__(self, size: int) -> None:
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.buf = bytearray(size)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.lsock.accept()
        with conn:
            view = memoryview(self.buf)
            while True:
                got = 0
                while got < len(view):
                    k = conn.recv_into(view[got:])
                    if k == 0:
                        return
                    got += k
                conn.sendall(b"k")

    def close(self) -> None:
        self.lsock.close()
        self.thread.join(timeout=10)


def run(cfg: RunConfig) -> BenchResult:
    size = (10 if cfg.quick else 100) * MB
    rounds = 3 if cfg.quick else 9
    part = memoryview(os.urandom(size))
    digest = checksum(part)
    server = PeerServer("127.0.0.1", Replicas(4 * size), TOKEN, JOB)
    client = PeerClient("127.0.0.1", server.port, TOKEN, JOB)
    raw = _Raw(size)
    sock = socket.create_connection(("127.0.0.1", raw.port))
    steps = iter(range(10**9))
    try:
        def sample(name: str) -> float:
            t0 = time.perf_counter()
            if name == "peer tier":
                client.put("bench", 0, 1, next(steps), digest, part)
            else:
                sock.sendall(part)
                assert sock.recv(1) == b"k"
            return size / MB / (time.perf_counter() - t0)

        cfg.log(f"peer: {size // MB} MB part, {rounds} transfers each")
        got = interleaved(["peer tier", "raw TCP"], sample, rounds)
    finally:
        sock.close()
        raw.close()
        client.close()
        server.close()
        server.replicas.close()
    return BenchResult(
        name="peer", title=TITLE, description=__doc__ or "", unit="MB/s", higher_is_better=True,
        rows=[Comparison({"part": f"{size // MB} MB"}, Measured("peer tier (put)", got["peer tier"]),
                         Measured("raw loopback TCP", got["raw TCP"]))],
        params={"size_mb": size // MB, "rounds": rounds},
        notes=["The peer tier's transfer includes verifying the checksum (XXH3-64) on the receiver "
               "before the replica is kept; raw TCP only moves the bytes."],
    )

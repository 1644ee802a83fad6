"""Where a hosted c10d store listens, and asking a c10d store to answer, both with our own sockets.

torch's ``TCPStore`` server binds every interface (``::``) unless it is handed a socket that is
already listening (``master_listen_fd``); so elastictk binds that socket itself, to the address
the job reaches the store by (loopback for a one-node job). And torch's client, pointed at a
port where something that is not a TCPStore listens (a silent listener), retries inside C++ for
its whole timeout and does not see Ctrl-C; :func:`ping_store` asks first, with a deadline of
ours, in the store's own wire protocol (a validate message, then a ping it must echo).
"""
from __future__ import annotations

import ipaddress
import os
import socket
import struct
import time

from .endpoint import Endpoint, connect

# c10d's TCPStore wire protocol (torch/csrc/distributed/c10d/TCPStoreBackend.hpp): a one-byte
# query type, then native-endian integers. VALIDATE carries a magic number; PING a nonce that
# the server sends straight back.
_VALIDATE, _PING, _MAGIC = 0, 13, 0x3C85F7CE

#: Longest wait for a store's answer to the ping: a live TCPStore answers in milliseconds.
PING_DEADLINE = 5.0


def _addresses(host: str, port: int) -> list[tuple[int, tuple[str, int] | tuple[str, int, int, int]]]:
    """``host``'s addresses (IPv4 first, as a client resolving the name tries them first)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    return [(i[0], i[4]) for i in infos]  # type: ignore[misc]


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (a name is resolved; port 0: a free port).

    Raises ``OSError`` (the port is taken, the address is not this machine's) naming neither:
    the caller knows which flag the address came from.
    """
    family, addr = _addresses(host, port)[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as c10d's own listener does
        s.bind(addr)
        s.listen(socket.SOMAXCONN)
    except BaseException:
        s.close()
        raise
    return s


def is_unspecified(host: str) -> bool:
    """``0.0.0.0``/``::``: every interface."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def ping_store(endpoint: Endpoint, timeout: float) -> str | None:
    """``None`` when a c10d TCPStore answers at ``endpoint`` within ``timeout`` seconds (at
    most :data:`PING_DEADLINE` for its answer), else a short reason for an error line.

    Interruptible (a Python socket, not torch's C++ client): Ctrl-C stops it at once.
    """
    return probe_store(endpoint, timeout)[0]


def probe_store(endpoint: Endpoint, timeout: float) -> tuple[str | None, bool]:
    """:func:`ping_store`'s answer, and whether nothing took the connection at all (refused,
    unreachable, no answer to the connect): the one case where waiting can help, because the
    store's host may not listen yet. Something that took the connection and then did not answer
    as a TCPStore is another program on the port, and stays so."""
    start = time.monotonic()
    sock = connect(endpoint, timeout)
    if isinstance(sock, str):
        return sock, True
    return _ping(sock, timeout - (time.monotonic() - start)), False


def _ping(sock: socket.socket, left: float) -> str | None:
    wait = max(0.01, min(PING_DEADLINE, left))
    nonce = (os.getpid() ^ int(time.monotonic_ns())) & 0xFFFFFFFF
    with sock:
        sock.settimeout(wait)
        try:
            sock.sendall(struct.pack("=BI", _VALIDATE, _MAGIC) + struct.pack("=BI", _PING, nonce))
            answer = b""
            while len(answer) < 4:
                chunk = sock.recv(4 - len(answer))
                if not chunk:
                    return "it closed the connection without answering: not a TCPStore"
                answer += chunk
        except socket.timeout:
            return (f"something listens there but sent no TCPStore answer within {round(wait, 1):g}s "
                    "(another program holds the port?)")
        except OSError as e:
            return f"the connection failed during the TCPStore handshake ({e.strerror or e})"
    if struct.unpack("=I", answer)[0] != nonce:
        return "it answered, but not as a TCPStore does (another program holds the port?)"
    return None

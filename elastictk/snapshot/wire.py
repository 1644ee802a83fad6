"""Frames and the handshake the peer tier's agents speak to each other (no torch, no pickle).

A frame is ``u32 length (big endian) | JSON header``, followed by exactly ``header["nbytes"]``
raw bytes when the header says so. A connection opens with a challenge-response keyed by the
job's rendezvous token, so the token never crosses the wire and neither side can be replayed::

    server -> {"hello": "elastictk-peer/1", "auth": "hmac-sha256" | "none", "nonce": <32 hex>}
    client -> {"nonce": <32 hex>, "mac": HMAC(token, CONTEXT|"client"|job|server nonce|client nonce)}
    server -> {"ok": true, "mac": HMAC(token, CONTEXT|"server"|job|server nonce|client nonce)}

Both sides check the other's MAC: a client without the token is refused, and a client never
hands a part to (or takes one from) a server that does not know it. Without a token (a job run
without one) both say ``"none"`` and anyone who reaches the port is believed, as torchrun
believes its store.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
from typing import Any, Optional

CONTEXT = b"elastictk-peer/1"
LENGTH = struct.Struct(">I")
MAX_HEADER = 1 << 20  # a header is a few hundred bytes; more is not a peer of ours
CHUNK = 1 << 22  # bytes per recv_into/sendall call on large payloads


class WireError(ConnectionError):
    """The other side hung up, spoke something else, or failed the handshake."""


class Refused(WireError):
    """The handshake failed: the other side does not know the job's token (or we do not)."""


def mac(key: bytes, role: str, job: str, server_nonce: str, client_nonce: str) -> str:
    msg = b"\n".join((CONTEXT, role.encode(), job.encode(), server_nonce.encode(), client_nonce.encode()))
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def send(sock: socket.socket, header: dict[str, Any], payload: Optional[memoryview] = None) -> None:
    body = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    sock.sendall(LENGTH.pack(len(body)) + body)
    if payload is not None:
        for start in range(0, len(payload), CHUNK):
            sock.sendall(payload[start:start + CHUNK])


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` exactly; :class:`WireError` if the connection ends first."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], min(CHUNK, n - got))
        if k == 0:
            raise WireError(f"connection closed after {got} of {n} bytes")
        got += k


def recv(sock: socket.socket) -> dict[str, Any]:
    head = bytearray(LENGTH.size)
    recv_into(sock, memoryview(head))
    (n,) = LENGTH.unpack(head)
    if n > MAX_HEADER:
        raise WireError(f"a frame header of {n} bytes: not an elastictk peer")
    body = bytearray(n)
    recv_into(sock, memoryview(body))
    try:
        out = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise WireError("a frame header that is not JSON: not an elastictk peer") from None
    if not isinstance(out, dict):
        raise WireError("a frame header that is not a JSON object: not an elastictk peer")
    return out


def greet(sock: socket.socket, key: Optional[bytes], job: str) -> None:
    """The server's side of the handshake; :class:`Refused` (after telling the client) if the
    client does not prove it knows the token."""
    nonce = secrets.token_hex(16)
    send(sock, {"hello": CONTEXT.decode(), "auth": "hmac-sha256" if key else "none", "nonce": nonce})
    reply = recv(sock)
    theirs = reply.get("nonce")
    if key is None:
        if reply.get("mac") is not None:
            send(sock, {"ok": False, "why": "this job runs without a token"})
            raise Refused("the client has a token, this job runs without one")
        send(sock, {"ok": True})
        return
    good = isinstance(theirs, str) and isinstance(reply.get("mac"), str) and hmac.compare_digest(
        reply["mac"], mac(key, "client", job, nonce, theirs))
    if not good:
        send(sock, {"ok": False, "why": "not signed with this job's rendezvous token"})
        raise Refused("the client does not know this job's rendezvous token")
    send(sock, {"ok": True, "mac": mac(key, "server", job, nonce, str(theirs))})


def introduce(sock: socket.socket, key: Optional[bytes], job: str) -> None:
    """The client's side of the handshake; :class:`Refused` if either side lacks the token."""
    hello = recv(sock)
    if hello.get("hello") != CONTEXT.decode() or not isinstance(hello.get("nonce"), str):
        raise WireError("the other side is not an elastictk snapshot peer")
    nonce = secrets.token_hex(16)
    if hello.get("auth") == "none":
        if key is not None:
            raise Refused("the peer runs without a token, this node has one")
        send(sock, {"nonce": nonce})
    else:
        if key is None:
            send(sock, {"nonce": nonce})
            recv(sock)
            raise Refused("the peer requires the job's rendezvous token, this node has none")
        send(sock, {"nonce": nonce, "mac": mac(key, "client", job, hello["nonce"], nonce)})
    answer = recv(sock)
    if not answer.get("ok"):
        raise Refused(f"refused by the peer: {answer.get('why', 'no reason given')}")
    if key is not None:
        theirs = answer.get("mac")
        if not (isinstance(theirs, str)
                and hmac.compare_digest(theirs, mac(key, "server", job, hello["nonce"], nonce))):
            raise Refused("the peer does not know this job's rendezvous token")

"""The challenge-response that opens every peer-tier connection, keyed by the job's token.

The token never crosses the wire and neither side can be replayed::

    server -> {"hello": "elastictk-peer/1", "auth": "hmac-sha256" | "none", "nonce": <32 hex>}
    client -> {"nonce": <32 hex>, "mac": HMAC(token, CONTEXT|"client"|job|server nonce|client nonce)}
    server -> {"ok": true, "mac": HMAC(token, CONTEXT|"server"|job|server nonce|client nonce)}

Both sides check the other's MAC: a client without the token is refused, and a client never
hands a part to (or takes one from) a server that does not know it. Without a token (a job run
without one) both say ``"none"`` and anyone who reaches the port is believed, as torchrun
believes its store.

Before the handshake the other side is a stranger, so each side reads it under tight bounds:
:data:`MAX_HELLO` bytes per header and one deadline for the whole exchange.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
from typing import Optional

from . import messages
from .wire import Refused, WireError, recv, send

CONTEXT = b"elastictk-peer/1"
MAX_HELLO = 1024  # a handshake header is ~150 bytes


def mac(key: bytes, role: str, job: str, server_nonce: str, client_nonce: str) -> str:
    msg = b"\n".join((CONTEXT, role.encode(), job.encode(), server_nonce.encode(), client_nonce.encode()))
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def greet(sock: socket.socket, key: Optional[bytes], job: str, deadline: float) -> None:
    """The server's side; :class:`Refused` (after telling the client) if the client does not
    prove it knows the token, :class:`~.wire.Late` if it is not done by ``deadline``."""
    nonce = secrets.token_hex(16)
    send(sock, {"hello": CONTEXT.decode(), "auth": "hmac-sha256" if key else "none", "nonce": nonce})
    reply = recv(sock, MAX_HELLO, deadline)
    theirs = messages.client_nonce(reply)
    signed = messages.optional_mac(reply)
    if key is None:
        if signed is not None:
            send(sock, {"ok": False, "why": "this job runs without a token"})
            raise Refused("the client has a token, this job runs without one")
        send(sock, {"ok": True})
        return
    if signed is None or not hmac.compare_digest(signed, mac(key, "client", job, nonce, theirs)):
        send(sock, {"ok": False, "why": "not signed with this job's rendezvous token"})
        raise Refused("the client does not know this job's rendezvous token")
    send(sock, {"ok": True, "mac": mac(key, "server", job, nonce, theirs)})


def introduce(sock: socket.socket, key: Optional[bytes], job: str, deadline: Optional[float] = None) -> None:
    """The client's side; :class:`Refused` if either side lacks the token, :class:`~.wire.Late`
    if the server is not done by ``deadline`` (a server that trickles its hello cannot hold us)."""
    try:
        hello = messages.hello(recv(sock, MAX_HELLO, deadline))
    except messages.BadMessage as e:
        raise WireError(f"the other side is not an elastictk snapshot peer: {e}") from None
    if hello.hello != CONTEXT.decode():
        raise WireError("the other side is not an elastictk snapshot peer")
    nonce = secrets.token_hex(16)
    if hello.auth == "none":
        if key is not None:
            raise Refused("the peer runs without a token, this node has one")
        send(sock, {"nonce": nonce})
    else:
        if key is None:
            send(sock, {"nonce": nonce})
            recv(sock, MAX_HELLO, deadline)
            raise Refused("the peer requires the job's rendezvous token, this node has none")
        send(sock, {"nonce": nonce, "mac": mac(key, "client", job, hello.nonce, nonce)})
    raw = recv(sock, MAX_HELLO, deadline)
    answer = messages.answer(raw)
    if not answer.ok:
        raise Refused(f"refused by the peer: {answer.why}")
    if key is not None:
        theirs = messages.optional_mac(raw)
        if theirs is None or not hmac.compare_digest(theirs, mac(key, "server", job, hello.nonce, nonce)):
            raise Refused("the peer does not know this job's rendezvous token")

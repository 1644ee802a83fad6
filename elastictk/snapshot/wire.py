"""Frames the peer tier's agents speak to each other (no torch, no pickle).

A frame is ``u32 length (big endian) | JSON header``, followed by exactly the number of raw
bytes the header announces when it announces any. Reading a header is bounded three ways,
because its bytes come from whoever reached the port: a length limit the caller picks (a few
KiB before the handshake, more after), an optional deadline for the whole header (not per
byte: a peer that trickles one byte a second is still dropped on time), and a strict JSON parse
(no NaN or Infinity, no nesting deep enough to exhaust the parser, valid UTF-8, an object at
the top). Anything else is a :class:`WireError` in one line, never another exception. What the
fields mean and which values are valid is :mod:`.messages`' job.

Every exchange has an overall deadline on both sides, never only a per-call timeout: a peer
that sends (or reads) one byte a second resets a socket timeout forever, and would hold a
reservation of the memory bound, a connection slot or a round's start as long as it liked. A
payload's deadline grows with its size (:func:`payload_deadline`: a floor, plus the bytes at
:data:`MIN_RATE`), so an honest transfer of any size on a slow link still fits.
"""
from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any, Optional

LENGTH = struct.Struct(">I")
MAX_HEADER = 1 << 20  # the longest header read after the handshake (an index reply of many replicas)
CHUNK = 1 << 22  # bytes per recv_into/sendall call on large payloads
MIN_RATE = 16 << 20  # bytes/s: a payload slower than this (on top of its floor) is cut off


class WireError(ConnectionError):
    """The other side hung up, spoke something else, or failed the handshake."""


class Refused(WireError):
    """The handshake failed: the other side does not know the job's token (or we do not)."""


class Late(WireError):
    """The other side did not send what it had to before the deadline."""


def payload_deadline(nbytes: int, floor: float) -> float:
    """When a payload of ``nbytes`` started now must be done (``time.monotonic()``): ``floor``
    seconds, plus the bytes at :data:`MIN_RATE`."""
    return time.monotonic() + floor + nbytes / MIN_RATE


def _left(sock: socket.socket, deadline: Optional[float], what: str) -> None:
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Late(what)
        sock.settimeout(left)


def send(sock: socket.socket, header: dict[str, Any], payload: Optional[memoryview] = None,
         deadline: Optional[float] = None) -> None:
    """One frame, whole before ``deadline`` if one is given (:class:`Late` otherwise: the other
    side reads too slowly). With a deadline the socket's timeout is changed; the caller sets it
    again for what follows."""
    body = json.dumps(header, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    try:
        _left(sock, deadline, "the other side read nothing before the deadline")
        sock.sendall(LENGTH.pack(len(body)) + body)
    except TimeoutError:
        if deadline is None:
            raise
        raise Late("the other side read no header before the deadline") from None
    if payload is not None:
        send_payload(sock, payload, deadline)


def send_payload(sock: socket.socket, payload: memoryview, deadline: Optional[float] = None) -> None:
    """Raw bytes after a header, whole before ``deadline`` if one is given (:class:`Late`)."""
    sent = 0
    try:
        for sent in range(0, len(payload), CHUNK):
            _left(sock, deadline, f"the other side read {sent} of {len(payload)} bytes before the deadline")
            sock.sendall(payload[sent:sent + CHUNK])  # its timeout bounds the whole call
    except TimeoutError:
        if deadline is None:
            raise
        raise Late(f"the other side read at most {min(sent + CHUNK, len(payload))} of {len(payload)} bytes "
                   "before the deadline") from None


def recv_into(sock: socket.socket, view: memoryview, deadline: Optional[float] = None) -> None:
    """Fill ``view`` exactly; :class:`WireError` if the connection ends first, :class:`Late` if
    ``deadline`` (``time.monotonic()``) passes first. With a deadline the socket's timeout is
    changed; the caller sets it again for what follows."""
    got, n = 0, len(view)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Late(f"{got} of {n} bytes arrived before the deadline")
            sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], min(CHUNK, n - got))
        except TimeoutError:
            if deadline is None:
                raise
            continue  # the deadline check above says it
        if k == 0:
            raise WireError(f"connection closed after {got} of {n} bytes")
        got += k


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number here")


def parse(body: bytes) -> dict[str, Any]:
    """A header's bytes as a JSON object; :class:`WireError` naming why not."""
    try:
        out = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise WireError("a frame header that is not UTF-8: not an elastictk peer") from None
    except RecursionError:
        raise WireError("a frame header nested too deep: not an elastictk peer") from None
    except ValueError as e:  # json.JSONDecodeError, NaN/Infinity, an int of too many digits
        raise WireError(f"a frame header that is not JSON ({str(e)[:80]}): not an elastictk peer") from None
    if not isinstance(out, dict):
        raise WireError("a frame header that is not a JSON object: not an elastictk peer")
    return out


def recv(sock: socket.socket, limit: int = MAX_HEADER, deadline: Optional[float] = None) -> dict[str, Any]:
    """One header of at most ``limit`` bytes, whole before ``deadline`` if one is given."""
    head = bytearray(LENGTH.size)
    recv_into(sock, memoryview(head), deadline)
    (n,) = LENGTH.unpack(head)
    if n > limit:
        raise WireError(f"a frame header of {n} bytes (at most {limit} here): not an elastictk peer")
    body = bytearray(n)
    recv_into(sock, memoryview(body), deadline)
    return parse(bytes(body))

"""The fork server's wire, both ends: length-prefixed JSON frames with fds on a UNIX socket
(the owner's requests, the server's replies, a standby's promotion), and the worker's status
pipe. Apart from the server loop and its owner because both of them speak it, and a reader
of it should find the framing in one place."""
from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any, Mapping, Optional, Sequence

_LEN = struct.Struct("!I")
STATUS = struct.Struct("!i")
FD_NAMES = ("stdout", "stderr", "status", "result")


def send_frame(sock: socket.socket, header: Mapping[str, Any], payload: bytes = b"",
                fds: Sequence[int] = ()) -> None:
    body = json.dumps(header).encode()
    data = _LEN.pack(len(body)) + body + payload
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("control socket closed")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, maxfds: int = 0) -> tuple[dict[str, Any], bytes, list[int]]:
    head, fds, _, _ = socket.recv_fds(sock, _LEN.size, maxfds)
    if not head:
        raise EOFError("control socket closed")
    head += _recv_exact(sock, _LEN.size - len(head))
    (length,) = _LEN.unpack(head)
    header = json.loads(_recv_exact(sock, length))
    payload = _recv_exact(sock, int(header.get("payload_len", 0)))
    return header, payload, list(fds)


def read_status(fd: int) -> Optional[int]:
    """The return code on a worker's status pipe; None if the server closed it without one."""
    data = b""
    while len(data) < STATUS.size:
        chunk = os.read(fd, STATUS.size - len(data))
        if not chunk:
            return None
        data += chunk
    return STATUS.unpack(data)[0]

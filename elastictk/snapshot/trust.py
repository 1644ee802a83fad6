"""Whether a disk-tier step may be read at all: its directories, and the seal on ``COMPLETE``.

A step directory holds DCP's ``.metadata``, which DCP unpickles: whoever can put a step where
a restore looks runs code in every worker. So before any file of a step is opened for reading:

- the snapshot directory and the step directory must be private, as the FileStore requires of
  its own directory (:func:`private_dir`): real directories (not symlinks), owned by this
  user, not writable by group or others. That keeps out every other local user; it cannot
  keep out this user's other jobs, or a host that shares the filesystem under the same uid;
- with a key (:data:`~.settings.ENV_KEY`, derived by the agent from the job's token and job
  id, so a relaunch of the same job with the same token verifies the steps it wrote before),
  ``COMPLETE`` is sealed: ``HMAC-SHA256(key, CONTEXT | step directory name | body)``, checked
  over the raw bytes before the JSON is parsed (:func:`unseal`). The body names every file of
  the step with its checksum, ``.metadata`` included, so a step written without the key is
  never opened past ``COMPLETE``.

``COMPLETE``'s wire format: one line ``hmac-sha256 <64 hex>`` (or ``unsealed``), then the
JSON body (:func:`parse_body` says what it must hold). Its size is capped at :data:`MAX_MARKER`.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import re
import stat
from pathlib import Path
from typing import Any, Optional

from .._paths import owner_problem

CONTEXT = b"elastictk-snapshot/1"
SEALED, UNSEALED = b"hmac-sha256 ", b"unsealed"
MAX_MARKER = 64 << 20  # bytes: a marker names every rank's files; far above a 100k-rank job's
MAX_SMALL = 1 << 30  # bytes of .metadata or skeleton.pt read into memory to verify and parse
FILE_NAME = re.compile(r"(__\d+_\d+\.distcp|\.metadata|skeleton\.pt)$")
HEX16 = re.compile(r"[0-9a-f]{16}$")
HEX64 = re.compile(r"[0-9a-f]{64}$")
# A planted symlink fails to open (ELOOP); a FIFO or device opens without blocking, and fstat
# then refuses it.
READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


class Refused(Exception):
    """A step (or the whole directory) may not be read; the message says why, in one clause."""


def private_dir(path: Path) -> None:
    """Raise :class:`Refused` unless ``path`` is a real directory of this user that nobody else
    can write (the FileStore's rule for its own directory)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise Refused(f"{path}: {e.strerror or e}") from None
    if stat.S_ISLNK(st.st_mode):
        raise Refused(f"{path} is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"{path} is not a directory")
    problem = owner_problem(path, st)
    if problem is not None:
        raise Refused(problem)


def read_small(path: Path, limit: int) -> bytes:
    """The bytes of regular file ``path``, never through a symlink, at most ``limit`` of them."""
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise Refused(f"{path.name} is missing") from None
        why = "a symlink" if e.errno == errno.ELOOP else (e.strerror or str(e))
        raise Refused(f"{path.name}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{path.name} is not a regular file")
        if st.st_size > limit:
            raise Refused(f"{path.name} is {st.st_size} bytes, more than {limit}")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise Refused(f"{path.name} grew past {limit} bytes while read")
        return data
    finally:
        os.close(fd)


def mac(key: str, name: str, body: bytes) -> str:
    return hmac.new(key.encode(), b"\n".join((CONTEXT, name.encode(), body)), hashlib.sha256).hexdigest()


def seal(key: Optional[str], name: str, body: bytes) -> bytes:
    """``COMPLETE``'s bytes for ``body`` in step directory ``name``."""
    head = SEALED + mac(key, name, body).encode() if key else UNSEALED
    return head + b"\n" + body


def unseal(raw: bytes, key: Optional[str], name: str) -> bytes:
    """The body of ``COMPLETE`` bytes ``raw``, its seal checked first when there is a key."""
    head, sep, body = raw.partition(b"\n")
    if not sep:
        raise Refused("COMPLETE has no seal line")
    if key is None:
        if head != UNSEALED and not head.startswith(SEALED):
            raise Refused("COMPLETE's seal line is malformed")
        return body
    if not head.startswith(SEALED):
        raise Refused("COMPLETE is not sealed, and this job has a key (--rdzv-token): it was not "
                      "written by this job")
    got = head[len(SEALED):]
    if not hmac.compare_digest(got, mac(key, name, body).encode()):
        raise Refused("COMPLETE's seal does not verify with this job's key (--rdzv-token): it was "
                      "not written by this job")
    return body


def parse_body(body: bytes, step: int) -> dict[str, Any]:
    """The marker of ``step``: ``{"step", "world_size", "files": {name: xxh3 hex},
    "sha256": {name: hex}}`` with ``sha256`` naming ``.metadata`` and ``skeleton.pt``, the
    files read into memory and parsed. Anything else is :class:`Refused`."""
    try:
        m = json.loads(body)
    except (ValueError, RecursionError):
        raise Refused("COMPLETE is not JSON") from None
    if not isinstance(m, dict) or type(m.get("step")) is not int or m["step"] != step:
        raise Refused(f"COMPLETE is not the marker of step {step}")
    files, sums = m.get("files"), m.get("sha256")
    if not isinstance(files, dict) or not isinstance(sums, dict):
        raise Refused("COMPLETE lists no files")
    for name, digest in files.items():
        if not FILE_NAME.match(name) or not isinstance(digest, str) or not HEX16.match(digest):
            raise Refused(f"COMPLETE lists a file it may not: {str(name)[:40]!r}")
    for name in (".metadata", "skeleton.pt"):
        digest = sums.get(name)
        if name not in files or not isinstance(digest, str) or not HEX64.match(digest):
            raise Refused(f"COMPLETE has no SHA-256 of {name}")
    if type(m.get("world_size")) is not int or m["world_size"] < 1:
        raise Refused("COMPLETE has no world size")
    return m


def usable_root(path: str) -> Optional[str]:
    """Why ``--snapshot-dir`` ``path`` cannot hold the disk tier, or None: checked once at
    start, so a file in the way, a foreign or shared directory or an unwritable parent is one
    line then, not a disk tier that silently writes nothing."""
    p = Path(os.path.abspath(path))
    if os.path.lexists(p):
        try:
            private_dir(p)
        except Refused as e:
            why = str(e)
            if os.path.islink(p):
                why += f"; pass the directory it points to ({os.path.realpath(p)}) if that one is yours"
            return why
        if not os.access(p, os.W_OK | os.X_OK):
            return f"{p} is not writable by this user"
        return None
    probe = p
    while not os.path.lexists(probe):
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory, so {p} cannot be made under it"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe}, where {p} would be made, is not writable by this user"
    return None

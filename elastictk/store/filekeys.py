"""How a file store's keys become file names, and a value the bytes of its file.

Apart from ``file.py`` because it is the store's on-disk format, pure and shared by every
participant (and every host on an NFS mount): changing it changes what other agents read.

- One file per key, ``k.<percent-escaped key>`` (keys may contain ``/``); a key too long for a
  file name lives in ``h.<sha256>`` with the key, length-prefixed, stored in front of the value.
- Temp files are ``t.<pid>.<random>``, lock files ``lock.<stripe>``: neither is ever a key.
"""
from __future__ import annotations

import hashlib
import zlib
from urllib.parse import quote_from_bytes, unquote_to_bytes

from .base import StoreError

LOCK_STRIPES = 64
"""How many lock files the keys are spread over (by CRC-32 of the key)."""

KEY, HASHED, TEMP, LOCK = "k.", "h.", "t.", "lock."
"""The name prefixes of key files, hashed key files, temp files and lock files."""
_MAX_NAME = 240  # below NAME_MAX (255) on every filesystem elastictk runs on
LEN_BYTES = 4
"""Bytes of the big-endian length of the key in front of a hashed file's value."""


def key_bytes(key: str) -> bytes:
    return key.encode("utf-8", "surrogatepass")


def key_file(key: str) -> str:
    """The file name that holds ``key``.

    Percent-escaping is a prefix code (``%`` itself is escaped), so a name starts with the
    escaped prefix exactly when the key starts with the prefix: ``keys(prefix)`` filters names
    without decoding them.
    """
    escaped = quote_from_bytes(key_bytes(key), safe="")
    if len(escaped) <= _MAX_NAME:
        return KEY + escaped
    return HASHED + hashlib.sha256(key_bytes(key)).hexdigest()


def names_prefix(prefix: str) -> str:
    """The start of every ``k.`` file name whose key starts with ``prefix``."""
    return KEY + quote_from_bytes(key_bytes(prefix), safe="")


def key_of(name: str) -> str:
    """The key a ``k.`` file name holds."""
    return unquote_to_bytes(name[len(KEY):]).decode("utf-8", "surrogatepass")


def lock_stripe(key: str) -> int:
    """Which lock file guards ``key``; stable across processes and hosts."""
    return zlib.crc32(key_bytes(key)) % LOCK_STRIPES


def frame(key: str, name: str, value: bytes) -> bytes:
    """What file ``name`` holds for ``value``: a hashed file carries its key in front."""
    if name.startswith(HASHED):
        kb = key_bytes(key)
        return len(kb).to_bytes(LEN_BYTES, "big") + kb + value
    return value


def unframe(key: str, name: str, data: bytes, where: str) -> bytes:
    """The value in file ``name``'s bytes; a hashed file must hold ``key`` (else StoreError)."""
    if name.startswith(HASHED):
        kb = key_bytes(key)
        n = int.from_bytes(data[:LEN_BYTES], "big")
        if data[LEN_BYTES:LEN_BYTES + n] != kb:
            raise StoreError(f"{name} in {where} does not hold key {key!r}")
        data = data[LEN_BYTES + n:]
    return data

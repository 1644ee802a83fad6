"""What a child forked from the launcher drops of its owner's secrets before it serves workers.

The preload server is forked from ``elastictk-run`` after its flags were parsed, so it starts
with the launcher's whole memory: the :class:`~elastictk.cli.LaunchConfig` on the stack
(``rdzv_token``), ``main()``'s argv list, ``sys.argv`` (``--rdzv-token X``), ``os.environ``
and the C environment block (``ELASTICTK_RDZV_TOKEN``). Workers fork from that server, and run
user code: docs/security.md promises that no worker holds the token. :func:`forget_secrets`
runs first in the forked child and takes every such copy away: references dropped, and the
bytes of the strings that held the token overwritten in this process (the owner's pages are
its own after the fork, so nothing changes there).
"""
from __future__ import annotations

import ctypes
import gc
import os
import sys
from types import FrameType
from typing import Any

from .env import WITHHELD

#: Attributes of the owner's objects (``LaunchConfig``) that hold a secret.
SECRET_ATTRS = ("rdzv_token",)
#: Command-line flags whose value is a secret (``--rdzv-token X`` or ``--rdzv-token=X``).
SECRET_FLAGS = ("--rdzv-token", "--rdzv_token")
MASK = "<withheld>"


def forget_secrets() -> int:
    """Drop and overwrite the owner's secrets in this (forked) process; how many copies."""
    found: list[object] = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        for value in list(frame.f_locals.values()):
            _forget_in(value, found)
        frame = frame.f_back
    for argv in (sys.argv, getattr(sys, "orig_argv", [])):
        _mask_argv(argv, found)
    for name in WITHHELD:
        _forget_env(name, found)
    for value in found:
        _overwrite(value)
    count = len(found)
    found.clear()
    gc.collect()  # the owner's parse left cycles (argparse) that may still reach a copy
    return count


def _forget_in(value: Any, found: list[object]) -> None:
    if isinstance(value, list):
        _mask_argv(value, found)
        return
    if isinstance(value, type):
        return
    try:  # the instance's own attributes only: no __getattr__ of a lazy module runs here
        attrs = object.__getattribute__(value, "__dict__")
    except AttributeError:
        return
    if not isinstance(attrs, dict):
        return
    for attr in SECRET_ATTRS:
        secret = attrs.get(attr)
        if isinstance(secret, str) and secret:
            found.append(secret)
            attrs[attr] = None  # LaunchConfig is a frozen dataclass: its __setattr__ refuses


def _mask_argv(argv: list[Any], found: list[object]) -> None:
    """``--rdzv-token X`` and ``--rdzv-token=X`` in an argv list, masked in place."""
    for i, arg in enumerate(argv):
        if not isinstance(arg, str):
            continue
        if arg in SECRET_FLAGS and i + 1 < len(argv) and isinstance(argv[i + 1], str):
            found.append(argv[i + 1])
            argv[i + 1] = MASK
        elif arg.startswith(tuple(f + "=" for f in SECRET_FLAGS)):
            found.append(arg)
            argv[i] = arg.partition("=")[0] + "=" + MASK


def _forget_env(name: str, found: list[object]) -> None:
    """``name`` out of ``os.environ`` (its bytes object overwritten) and out of the C
    environment block, whose bytes are overwritten where the kernel shows them
    (``/proc/PID/environ`` reads that block)."""
    import posix

    key = os.fsencode(name)
    raw = posix.environ.get(key)
    if isinstance(raw, bytes):
        found.append(raw)
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_void_p
    at = libc.getenv(key)
    if at:
        ctypes.memset(at, 0, len(ctypes.string_at(at)))
    os.environ.pop(name, None)  # unsetenv too
    posix.environ.pop(key, None)


def _overwrite(value: object) -> None:
    """Zero the characters of a str (compact ASCII only: the layout CPython documents as
    fixed) or a bytes object in this process, so that neither it nor the memory it leaves
    when freed holds the secret. Other layouts are left alone (only their references went),
    and so are objects of one character: CPython shares those (every ``"a"``, every ``b"a"``
    is one object), and zeroing one would change it for the whole process."""
    if len(value) < 2:  # type: ignore[arg-type]
        return
    if isinstance(value, bytes):
        offset = bytes.__basicsize__ - 1  # ob_sval
        ctypes.memset(id(value) + offset, 0, len(value))
    elif isinstance(value, str) and value.isascii() and type(value) is str:
        offset = sys.getsizeof("") - 1  # sizeof(PyASCIIObject): the data follows it
        ctypes.memset(id(value) + offset, 0, len(value))

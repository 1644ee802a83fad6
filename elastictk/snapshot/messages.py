"""Every field of the peer tier's wire messages, checked in one place.

A frame header (:mod:`.wire`) is JSON from another process: even after the handshake it comes
from a peer that may be buggy, older, or run by someone who holds the job's token and means
harm. So no caller reads a header's fields itself: each message has a parser here that returns
plain typed values or raises :class:`BadMessage` (a :class:`~.wire.WireError`) naming the field
and what was wrong, in one line. Integers are ints (never bools, floats, NaN or Infinity) within
stated ranges, strings are strings of bounded length, lists are lists of bounded length. A
negative size can therefore never reach the memory bound's arithmetic, and an ``index`` reply
that is not a list is a refused message, not a ``TypeError`` in the round's start.

A peer's words reach this agent's log, so no string from it is printed as it came: names
(origins, addresses, ops) must be printable (no newline, no control or format character) or
the message is refused, and free text (a refusal's reason) is kept only as :func:`shown`
makes it: escaped and cut to :data:`SHOWN` characters, so a peer cannot forge a line such as
``[elastictk-run] succeeded`` in the job's log. A part announces at least one byte: a
zero-byte part would cost the memory bound nothing while each kept replica still costs a
mapping (the replica count is bounded too, :mod:`.replicas`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from .replicas import Key
from .wire import WireError

MAX_WORLD = 1 << 20
MAX_STEP = (1 << 63) - 1
MAX_PART = 1 << 44  # 16 TiB: past any --snapshot-memory; the memory bound refuses what is too big
MAX_SUM = (1 << 64) - 1  # XXH3-64
MAX_ORIGIN = 256  # a node id
MAX_WHY = 1000  # a refusal's reason
SHOWN = 200  # characters of a peer's free text that reach the log
MAX_INDEX = 16384  # replicas one index reply may list
MAX_LOCAL = 4096  # local slots one index reply may list (two per local rank)
NONCE = re.compile(r"[0-9a-f]{32}")
MAC = re.compile(r"[0-9a-f]{64}")


class BadMessage(WireError):
    """A header with a missing, mistyped or out-of-range field; the message names it."""


def integer(h: Mapping[str, Any], name: str, low: int, high: int) -> int:
    v = h.get(name)
    if type(v) is not int:  # bool is an int subclass; floats (NaN, Infinity) are not ints
        raise BadMessage(f"field {name!r} is {_show(v)}, not an integer")
    if not low <= v <= high:
        raise BadMessage(f"field {name!r} is {v}, outside {low}..{high}")
    return v


def text(h: Mapping[str, Any], name: str, limit: int, pattern: "re.Pattern[str] | None" = None,
         printable: bool = True) -> str:
    """A string field; with ``printable`` (the default) one holding a newline, a control or a
    format character is refused (it would be printed in a log line)."""
    v = h.get(name)
    if not isinstance(v, str):
        raise BadMessage(f"field {name!r} is {_show(v)}, not a string")
    if len(v) > limit:
        raise BadMessage(f"field {name!r} is {len(v)} characters long, more than {limit}")
    if printable and not v.isprintable():
        raise BadMessage(f"field {name!r} holds a character that cannot be printed")
    if pattern is not None and not pattern.fullmatch(v):
        raise BadMessage(f"field {name!r} is not {pattern.pattern}")
    return v


def shown(v: str, limit: int = SHOWN) -> str:
    """A peer's free text as it may be printed: quoted, every character that is not printable
    escaped (newlines, carriage returns, ANSI escapes, bidi overrides), at most ``limit``
    characters of it."""
    return repr(v[:limit]) + (f" (+{len(v) - limit} characters)" if len(v) > limit else "")


def flag(h: Mapping[str, Any], name: str) -> bool:
    v = h.get(name)
    if type(v) is not bool:
        raise BadMessage(f"field {name!r} is {_show(v)}, not true or false")
    return v


def _show(v: Any) -> str:
    if v is None:
        return "missing"
    return f"a {type(v).__name__}" if isinstance(v, (dict, list, str)) else repr(v)[:40]


# -- handshake --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    hello: str
    auth: str  # "hmac-sha256" or "none"
    nonce: str


def hello(h: Mapping[str, Any]) -> Hello:
    auth = text(h, "auth", 32)
    if auth not in ("hmac-sha256", "none"):
        raise BadMessage(f"field 'auth' is {auth!r}, not 'hmac-sha256' or 'none'")
    return Hello(text(h, "hello", 64), auth, text(h, "nonce", 32, NONCE))


def client_nonce(h: Mapping[str, Any]) -> str:
    return text(h, "nonce", 32, NONCE)


def optional_mac(h: Mapping[str, Any]) -> "str | None":
    return None if h.get("mac") is None else text(h, "mac", 64, MAC)


# -- replies ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    ok: bool
    why: str


def answer(h: Mapping[str, Any]) -> Answer:
    """``{"ok": bool, "why": str?}``: every reply starts with it; ``why`` as :func:`shown`."""
    ok = flag(h, "ok")
    why = "no reason given" if h.get("why") is None else shown(text(h, "why", MAX_WHY, printable=False))
    return Answer(ok, why)


def key(h: Any) -> Key:
    """One replica's identity (an index entry, or a put request's fields)."""
    if not isinstance(h, dict):
        raise BadMessage(f"a replica entry is {_show(h)}, not an object")
    world = integer(h, "world", 1, MAX_WORLD)
    rank = integer(h, "rank", 0, world - 1)
    origin = text(h, "origin", MAX_ORIGIN)
    if not origin:
        raise BadMessage("field 'origin' is empty")
    return Key(origin, rank, world, integer(h, "step", 0, MAX_STEP))


def index_reply(h: Mapping[str, Any]) -> list[Key]:
    reply = answer(h)
    if not reply.ok:
        raise BadMessage(f"index refused: {reply.why}")
    entries = h.get("replicas")
    if not isinstance(entries, list):
        raise BadMessage(f"field 'replicas' is {_show(entries)}, not a list")
    if len(entries) > MAX_INDEX:
        raise BadMessage(f"field 'replicas' lists {len(entries)} replicas, more than {MAX_INDEX}")
    return [key(e) for e in entries]


@dataclass(frozen=True)
class Held:
    """A step the answering agent holds in one of its local slots, ready and checksummed."""

    rank: int
    world: int
    step: int


def held(h: Any) -> Held:
    if not isinstance(h, dict):
        raise BadMessage(f"a local slot entry is {_show(h)}, not an object")
    world = integer(h, "world", 1, MAX_WORLD)
    return Held(integer(h, "rank", 0, world - 1), world, integer(h, "step", 0, MAX_STEP))


def index_local(h: Mapping[str, Any]) -> list[Held]:
    """The ``local`` field of an index reply: the steps the answering agent holds in its local
    slots (absent: none said, as an older agent answers)."""
    entries = h.get("local")
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise BadMessage(f"field 'local' is {_show(entries)}, not a list")
    if len(entries) > MAX_LOCAL:
        raise BadMessage(f"field 'local' lists {len(entries)} slots, more than {MAX_LOCAL}")
    return [held(e) for e in entries]


@dataclass(frozen=True)
class Part:
    nbytes: int
    digest: int
    origin: str


def get_reply(h: Mapping[str, Any], limit: int) -> Part:
    """The header before a replica's bytes; ``limit`` bounds what this side will allocate."""
    nbytes = integer(h, "nbytes", 0, limit)
    return Part(nbytes, integer(h, "sum", 0, MAX_SUM), text(h, "origin", MAX_ORIGIN))


# -- requests ---------------------------------------------------------------------------------------
OPS = ("put", "index", "get")


def op(h: Mapping[str, Any]) -> str:
    name = text(h, "op", 16)
    if name not in OPS:
        raise BadMessage(f"unknown request {name!r}")
    return name


@dataclass(frozen=True)
class Put:
    key: Key
    nbytes: int
    digest: int


def put_request(h: Mapping[str, Any]) -> Put:
    """A part to keep: at least one byte (see the module's docstring)."""
    return Put(key(h), integer(h, "nbytes", 1, MAX_PART), integer(h, "sum", 0, MAX_SUM))


def get_request(h: Mapping[str, Any]) -> tuple[int, int, int]:
    """(rank, world, step)."""
    world = integer(h, "world", 1, MAX_WORLD)
    return integer(h, "rank", 0, world - 1), world, integer(h, "step", 0, MAX_STEP)


def endpoint(meta: Mapping[str, Any], port_key: str) -> "tuple[str, int] | None":
    """A member's peer server (address, port) from its sealed join record, or None if it has none
    or it is malformed."""
    try:
        return text(meta, "addr", 255), integer(meta, port_key, 1, 65535)
    except BadMessage:
        return None

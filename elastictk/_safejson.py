"""JSON from outside the process (store values, files others write), parsed so it cannot hurt.

``json.loads`` trusts its input: a kilobyte of ``[`` raises ``RecursionError`` (which no
``except ValueError`` catches, so a watch thread dies of it), a huge value takes memory, and
``NaN``, ``Infinity`` or ``1e999`` become floats no record of elastictk ever holds. Every
reader of such bytes goes through :func:`loads`: it returns plain JSON data, or raises
:class:`Unreadable` (a ``ValueError``) with one line saying what was wrong, and nothing else.

Bounds, said once here: a store record is at most :data:`MAX_RECORD_BYTES`; any value nests at
most :data:`MAX_DEPTH` arrays/objects deep (elastictk's own records nest four); numbers are
finite; text is valid UTF-8 without lone surrogates (which could not be printed or logged).

It sits beside the layers (every package may use it; it imports none of them).
"""
from __future__ import annotations

import json
import math
from typing import Any, NoReturn

MAX_RECORD_BYTES = 1 << 20  # 1 MiB: a store record larger than this is not elastictk's
MAX_DEPTH = 64

__all__ = ["MAX_DEPTH", "MAX_RECORD_BYTES", "Unreadable", "loads", "loads_object"]


class Unreadable(ValueError):
    """The bytes are not JSON that elastictk reads; ``str()`` says why, in one line."""


def _no_constant(name: str) -> NoReturn:
    raise Unreadable(f"{name} is not a number elastictk reads")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Unreadable(f"number {text[:20]!r} is out of range")
    return value


def loads(raw: bytes | bytearray | memoryview | str, *, max_bytes: int | None = MAX_RECORD_BYTES,
          max_depth: int = MAX_DEPTH) -> Any:
    """``raw`` parsed as JSON; :class:`Unreadable` (one line) for anything else.

    ``max_bytes`` bounds the input before anything is decoded (None: no bound, for callers
    that bounded their read themselves)."""
    size = len(raw)
    if max_bytes is not None and size > max_bytes:
        raise Unreadable(f"{size} bytes, more than the {max_bytes} a record may have")
    try:
        text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8")
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except Unreadable:
        raise
    except UnicodeDecodeError as e:
        raise Unreadable(f"not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise Unreadable(f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise Unreadable(f"nested deeper than the {max_depth} levels a record may have") from None
    except MemoryError:
        raise Unreadable(f"{size} bytes too large to parse") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise Unreadable(f"not JSON that elastictk reads ({str(e).splitlines()[0][:120]})") from None
    _check(value, max_depth)
    return value


def loads_object(raw: bytes | bytearray | memoryview | str, *, max_bytes: int | None = MAX_RECORD_BYTES,
                 max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """:func:`loads` for a value that must be a JSON object."""
    value = loads(raw, max_bytes=max_bytes, max_depth=max_depth)
    if not isinstance(value, dict):
        raise Unreadable(f"a JSON {_kind(value)}, not an object")
    return value


def _check(value: Any, max_depth: int) -> None:
    """Depth and text checks on parsed data, without recursion (the data may be deep)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _text(item)
        elif isinstance(item, (list, dict)):
            if depth > max_depth:
                raise Unreadable(f"nested deeper than the {max_depth} levels a record may have")
            if isinstance(item, dict):
                for k, v in item.items():
                    _text(k)
                    stack.append((v, depth + 1))
            else:
                stack.extend((v, depth + 1) for v in item)


def _text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise Unreadable("text with a lone surrogate (\\ud800-\\udfff), which is not UTF-8") from None


def _kind(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)

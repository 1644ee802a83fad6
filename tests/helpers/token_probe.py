"""A worker that looks for the job's token in its own memory and writes what it found.

It is given the token's first characters and the SHA-256 of the whole token, never the token:
a place holding the prefix is a hit when the bytes after it complete a string with that
digest. Looked at: every string and bytes object the garbage collector can reach (the
referents of every tracked container, which covers module globals, instances, argv and
``os.environ``), the locals of every frame on every thread's stack (and the attributes and
items one level into them), ``/proc/self/environ`` (the environment block the process
started with), and, with ``--memory``, every anonymous mapping of the process through
``/proc/self/mem`` (heap, stack, arenas: also memory freed but not overwritten).

usage: token_probe.py PREFIX SHA256 LENGTH OUT [--memory]
"""
from __future__ import annotations

import gc
import hashlib
import json
import sys
from typing import Any, Iterable

PREFIX, DIGEST, LENGTH, OUT = sys.argv[1].encode(), sys.argv[2], int(sys.argv[3]), sys.argv[4]
MEMORY = "--memory" in sys.argv[5:]


def hit(data: bytes) -> bool:
    i = data.find(PREFIX)
    while i >= 0:
        if hashlib.sha256(data[i:i + LENGTH]).hexdigest() == DIGEST:
            return True
        i = data.find(PREFIX, i + 1)
    return False


def raw(o: Any) -> bytes | None:
    if isinstance(o, str):
        return o.encode("utf-8", "surrogatepass")
    if isinstance(o, (bytes, bytearray)):
        return bytes(o)
    return None


def inside(o: Any) -> Iterable[Any]:
    """``o`` and what it holds one level down (items, values, attributes)."""
    yield o
    if isinstance(o, (list, tuple, set, frozenset)):
        yield from o
    elif isinstance(o, dict):
        yield from o.keys()
        yield from o.values()
    slots = getattr(o, "__dict__", None)
    if isinstance(slots, dict):
        yield from slots.values()


def main() -> None:
    found: list[str] = []
    for obj in gc.get_objects():
        for ref in gc.get_referents(obj):
            b = raw(ref)
            if b is not None and hit(b):
                found.append(f"a string held by a {type(obj).__name__}")
    for frame in sys._current_frames().values():
        f: Any = frame
        while f is not None:
            for name, value in list(f.f_locals.items()):
                for v in inside(value):
                    b = raw(v)
                    if b is not None and hit(b):
                        found.append(f"frame {f.f_code.co_name}, local {name}")
            f = f.f_back
    with open("/proc/self/environ", "rb") as e:
        if hit(e.read()):
            found.append("/proc/self/environ")
    regions = 0
    if MEMORY:
        with open("/proc/self/maps") as m:
            maps = m.read().splitlines()
        with open("/proc/self/mem", "rb", buffering=0) as mem:
            for line in maps:
                fields = line.split()
                where = fields[5] if len(fields) > 5 else ""
                if "r" not in fields[1] or where not in ("", "[heap]", "[stack]"):
                    continue
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                at = lo
                while at < hi:
                    size = min(hi - at, 64 << 20)
                    try:
                        mem.seek(at)
                        chunk = mem.read(size + LENGTH if at + size < hi else size)
                    except OSError:
                        break
                    if hit(chunk):
                        found.append(f"memory {where or 'anonymous'} {fields[0]}")
                        break
                    at += size
                regions += 1
    with open(OUT, "w") as f:
        json.dump({"found": sorted(set(found)), "objects": len(gc.get_objects()), "regions": regions}, f)


main()

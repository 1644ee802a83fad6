"""``chaos-timeline.png``: ranks over time, with faults and restarts, drawn without a plotting
library (a small raster and the PNG format's own zlib stream; a chaos run needs one picture,
not a dependency).

Rows are ranks (``R0``, ``R1``, ...), green where that rank's worker was running, red ticks
where a fault hit it, blue columns where the agent restarted the job, and a time axis in
seconds along the bottom.
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Callable, Optional

from .runner import RunRecord

_LEFT, _TOP, _ROW_H, _GAP = 44, 12, 22, 6  # lane geometry, pixels

GREEN, RED, BLUE, GREY, BLACK, WHITE = (60, 170, 80), (220, 40, 40), (50, 90, 220), \
    (225, 225, 225), (30, 30, 30), (255, 255, 255)
_FONT = {  # 3x5 glyphs, rows top to bottom
    "0": ("111", "101", "101", "101", "111"), "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"), "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"), "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"), "7": ("111", "001", "010", "010", "010"),
    "8": ("111", "101", "111", "101", "111"), "9": ("111", "101", "111", "001", "111"),
    "R": ("110", "101", "110", "101", "101"), "s": ("000", "011", "110", "011", "110"),
    ".": ("000", "000", "000", "000", "010"), "N": ("101", "111", "111", "111", "101"),
}
ORANGE = (240, 150, 30)


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.w, self.h = width, height
        self.px = bytearray(WHITE * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, rgb: tuple[int, int, int]) -> None:
        x0, x1 = max(0, min(x0, x1)), min(self.w, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.h, max(y0, y1))
        row = bytes(rgb) * (x1 - x0)
        for y in range(y0, y1):
            i = (y * self.w + x0) * 3
            self.px[i:i + len(row)] = row

    def text(self, x: int, y: int, s: str, rgb: tuple[int, int, int] = BLACK, scale: int = 2) -> None:
        for ch in s:
            glyph = _FONT.get(ch)
            if glyph:
                for gy, bits in enumerate(glyph):
                    for gx, b in enumerate(bits):
                        if b == "1":
                            self.rect(x + gx * scale, y + gy * scale, x + (gx + 1) * scale,
                                      y + (gy + 1) * scale, rgb)
            x += 4 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3]) for y in range(self.h))

        def chunk(tag: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

        head = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(raw, 9)) + \
            chunk(b"IEND", b"")


def draw(rec: RunRecord, path: Path, world: int, width: int = 960) -> Path:
    """Write the timeline of ``rec`` (a job of ``world`` ranks on one node) to ``path``; a
    multi-node run gets a row per node instead (``N0``, ``N1``...), orange where the store was
    out."""
    if rec.nodes > 1:
        return _draw_nodes(rec, path, world // rec.nodes, width)
    c, x, y = _lanes(rec, width, world, "R")
    start: Optional[float] = None
    ranks: list[int] = []
    for e in rec.events + [None]:  # type: ignore[operator]
        kind = None if e is None else e.kind
        if start is not None and (e is None or kind in ("worker_failed", "peer_failed", "workers_stopped",
                                                       "job_finished", "job_failed", "timer_expired")):
            end = rec.ended if e is None else e.mono
            for r in ranks:
                c.rect(x(start), y(r) + 3, x(end), y(r) + _ROW_H - 3, GREEN)
            start = None
        if e is not None and kind == "workers_started":
            start = e.mono
            ranks = [int(k) for k in (e.fields.get("pids") or {}) if int(k) < world]
        elif e is not None and kind == "restart":
            c.rect(x(e.mono) - 1, _TOP - 4, x(e.mono) + 2, y(world) - _GAP + 4, BLUE)
    for inj in rec.injections:
        hit = [int(inj.target.split(":")[1])] if inj.target.startswith("rank:") else list(range(world))
        for r in hit:
            if r < world:
                c.rect(x(inj.mono) - 2, y(r) - 3, x(inj.mono) + 3, y(r) + _ROW_H + 3, RED)
    _axis(c, rec, x, y(world) + 2, _LEFT, width, max(1e-6, rec.ended - rec.started))
    path.write_bytes(c.png())
    return path


def _axis(c: Canvas, rec: RunRecord, x, base: int, left: int, width: int, span: float) -> None:  # type: ignore[no-untyped-def]
    c.rect(left, base, width - 10, base + 1, BLACK)
    step = max(1, int(span / 8) or 1)
    t = 0
    while t <= span:
        c.rect(x(rec.started + t), base, x(rec.started + t) + 1, base + 5, BLACK)
        c.text(x(rec.started + t) - 4, base + 8, f"{t}s")
        t += step


def _lanes(rec: RunRecord, width: int, count: int, tag: str
           ) -> tuple[Canvas, Callable[[float], int], Callable[[int], int]]:
    """A canvas with one grey lane per rank or node, labelled, and the time (x) and lane (y)
    to pixel maps."""
    c = Canvas(width, _TOP + count * (_ROW_H + _GAP) + 30)
    span = max(1e-6, rec.ended - rec.started)

    def x(t: float) -> int:
        return _LEFT + int((t - rec.started) / span * (width - _LEFT - 10))

    def y(lane: int) -> int:
        return _TOP + lane * (_ROW_H + _GAP)

    for lane in range(count):
        c.rect(_LEFT, y(lane), width - 10, y(lane) + _ROW_H, GREY)
        c.text(6, y(lane) + 6, f"{tag}{lane}")
    return c, x, y


def _draw_nodes(rec: RunRecord, path: Path, nproc: int, width: int) -> Path:
    nodes = rec.nodes
    c, x, y = _lanes(rec, width, nodes, "N")
    since: dict[int, float] = {}
    stops = ("worker_failed", "peer_failed", "workers_stopped", "job_finished", "job_failed", "timer_expired",
             "membership_changed", "store_lost")
    marks = [(e.mono, e.fields.get("node"), e.kind) for e in rec.events]
    # A killed agent logs nothing more: its workers stop at the kill.
    marks += [(i.mono, int(i.target.split(":")[1]), "killed") for i in rec.injections if i.kind == "kill-agent"]
    for t, n, kind in sorted(marks, key=lambda m: m[0]):
        if n is None or not 0 <= n < nodes:
            continue
        if kind == "workers_started":
            since.setdefault(n, t)
        elif (kind in stops or kind == "killed") and n in since:
            c.rect(x(since.pop(n)), y(n) + 3, x(t), y(n) + _ROW_H - 3, GREEN)
        if kind == "restart":
            c.rect(x(t) - 1, y(n) - 3, x(t) + 2, y(n) + _ROW_H + 3, BLUE)
    for n, t in since.items():
        c.rect(x(t), y(n) + 3, x(rec.ended), y(n) + _ROW_H - 3, GREEN)
    for inj in rec.injections:  # an outage is a stretch, not a moment: a band along every row
        if inj.kind.startswith("store-outage"):
            end = inj.mono + float(inj.kind.split(":", 1)[1])
            for n in range(nodes):
                c.rect(x(inj.mono), y(n), x(end), y(n) + 3, ORANGE)
                c.rect(x(inj.mono), y(n) + _ROW_H - 3, x(end), y(n) + _ROW_H, ORANGE)
    for inj in rec.injections:
        if inj.kind.startswith("store-outage"):
            continue
        kind, _, idx = inj.target.partition(":")
        n = int(idx) if kind == "node" else int(idx) // max(1, nproc) if kind == "rank" else -1
        if 0 <= n < nodes:
            c.rect(x(inj.mono) - 2, y(n) - 3, x(inj.mono) + 3, y(n) + _ROW_H + 3, RED)
    _axis(c, rec, x, y(nodes) + 2, _LEFT, width, max(1e-6, rec.ended - rec.started))
    path.write_bytes(c.png())
    return path

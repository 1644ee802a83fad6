"""The disk tier: every N commits each rank writes its part; the last one marks the step complete.

Layout under ``--snapshot-dir``::

    step-0000000120/rank-00000.part     header (magic, step, length, checksum, rank, world) + data
    step-0000000120/rank-00001.part
    step-0000000120/COMPLETE            written once every rank's part is in place

A part is written to a temporary name, fsynced and renamed into place; each rank then adds one
to ``elastictk/snapshot/<step>`` in the job's store (torch's default store), and the rank whose
add completes the count writes ``COMPLETE`` the same way and keeps only the newest
:data:`~elastictk.snapshot.settings.KEEP` complete steps. A step without ``COMPLETE`` is never
restored. The directory must be one all nodes see (a shared filesystem), as for any checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any, Optional

from .codec import checksum
from .settings import KEEP

PART_MAGIC = b"ETKPART2"
PART_HEADER = struct.Struct("<8sqQQII")  # magic, step, length, checksum (XXH3-64), rank, world
HEADER_SIZE = 64
COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"step-(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:010d}"


def part_path(root: Path, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank-{rank:05d}.part"


def _write_atomic(path: Path, chunks: list[Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        for c in chunks:
            f.write(c)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class Disk:
    def __init__(self, root: str, rank: int, world: int) -> None:
        self.root, self.rank, self.world = Path(root), rank, world

    def write(self, step: int, data: memoryview, digest: int, store: Any) -> bool:
        """Write this rank's part of ``step``; True if this call completed the step."""
        d = step_dir(self.root, step)
        d.mkdir(parents=True, exist_ok=True)
        head = bytearray(HEADER_SIZE)
        PART_HEADER.pack_into(head, 0, PART_MAGIC, step, len(data), digest, self.rank, self.world)
        _write_atomic(part_path(self.root, step, self.rank), [head, data])
        done = self.world == 1 or store is None
        if not done:
            done = int(store.add(f"elastictk/snapshot/{step}", 1)) == self.world
        if done:
            marker = json.dumps({"step": step, "world_size": self.world}).encode()
            _write_atomic(d / COMPLETE, [marker])
            self.prune()
        return done

    def complete_steps(self) -> list[int]:
        """Complete steps of this world size, newest first."""
        out = []
        try:
            entries = list(self.root.iterdir())
        except FileNotFoundError:
            return []
        for p in entries:
            m = _STEP_DIR.match(p.name)
            if not m or not (p / COMPLETE).exists():
                continue
            try:
                world = json.loads((p / COMPLETE).read_text()).get("world_size")
            except (OSError, ValueError):
                continue
            if world == self.world:
                out.append(int(m.group(1)))
        return sorted(out, reverse=True)

    def prune(self) -> None:
        complete = self.complete_steps()
        if len(complete) < 1:
            return
        keep = set(complete[:KEEP])
        oldest_kept = min(keep)
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and int(m.group(1)) not in keep and int(m.group(1)) < oldest_kept:
                shutil.rmtree(p, ignore_errors=True)

    def read(self, step: int) -> tuple[Optional[bytearray], str]:
        """This rank's part of ``step`` and "" if whole, else None and why not."""
        path = part_path(self.root, step, self.rank)
        try:
            raw = bytearray(path.read_bytes())
        except OSError as e:
            return None, f"cannot read {path}: {e.strerror or e}"
        if len(raw) < HEADER_SIZE:
            return None, f"{path} is cut short"
        magic, pstep, length, digest, rank, world = PART_HEADER.unpack_from(raw, 0)
        if magic != PART_MAGIC or (pstep, rank, world) != (step, self.rank, self.world):
            return None, f"{path} is not rank {self.rank}'s part of step {step}"
        if len(raw) != HEADER_SIZE + length:
            return None, f"{path} is {len(raw)} bytes, its header says {HEADER_SIZE + length}"
        got = checksum(memoryview(raw)[HEADER_SIZE:])
        if got != digest:
            return None, f"checksum {got:016x} != {digest:016x}"
        del raw[:HEADER_SIZE]
        return raw, ""

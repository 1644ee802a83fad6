"""What a job asked of its snapshots: tiers, directory, cadence, memory bound (no torch).

The launcher reads ``--snapshot``, ``--snapshot-dir``, ``--snapshot-every``,
``--snapshot-memory`` and ``--snapshot-replicas``; workers read the same settings from the environment the agent gives
them (:data:`ENV_TIERS` ...), or from ``State(..., snapshot_dir=...)`` in code, which is how a
plain torchrun script gets the disk tier.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

TIERS = ("local", "peer", "disk")
TIER_HINT = "local, peer, disk or a comma list (local,peer,disk)"
ENV_TIERS = "ELASTICTK_SNAPSHOT"  # e.g. "local", "local,peer", "local,disk"
ENV_DIR = "ELASTICTK_SNAPSHOT_DIR"
ENV_EVERY = "ELASTICTK_SNAPSHOT_EVERY"
ENV_MEMORY = "ELASTICTK_SNAPSHOT_MEMORY"
ENV_REGIONS = "ELASTICTK_SNAPSHOT_REGIONS"  # /proc/<agent pid>/fd/<fd>
ENV_REGION_SIZE = "ELASTICTK_SNAPSHOT_REGION_SIZE"  # bytes per local rank
ENV_NOTIFY = "ELASTICTK_SNAPSHOT_NOTIFY"  # /proc/<agent pid>/fd/<fd>: a pipe, one byte per sealed slot
DEFAULT_REPLICAS = 1
ENV_OVERLAP = "ELASTICTK_SNAPSHOT_OVERLAP"  # "1": pipelined commits (overlap.py)
ENV_KEY = "ELASTICTK_SNAPSHOT_KEY"  # seals the disk tier's COMPLETE (trust.py); from the job's token
DEFAULT_EVERY = 10
KEEP = 2  # complete disk snapshots kept
PAGE = 4096
MIN_REGION = 4 * PAGE

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


class SettingsError(ValueError):
    """A snapshot setting is malformed; the message is one line naming it."""


def parse_tiers(text: str, what: str) -> tuple[str, ...]:
    """Tier names, comma separated (``peer`` implies ``local``: a node ships the parts its
    agent's memory holds); ``what`` names the input in an error line."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise SettingsError(f"{what}: name a tier: {TIER_HINT}")
    bad = [t for t in names if t not in TIERS]
    if bad:
        raise SettingsError(f"{what}: unknown tier {bad[0]!r}; use {TIER_HINT}")
    if "peer" in names:
        names.append("local")
    return tuple(t for t in TIERS if t in names)


def parse_replicas(text: str, what: str) -> int:
    """How many other nodes hold each node's parts (the peer tier)."""
    try:
        n = int(str(text).strip())
    except ValueError:
        n = 0
    if n < 1:
        raise SettingsError(f"{what}: a whole number of nodes, at least 1")
    return n


def parse_bytes(text: str, what: str, most: Optional[int] = None) -> int:
    """``1000000``, ``512M``, ``2G``, ``1.5GiB`` to bytes (decimal units; ``*iB`` binary), at
    least :data:`MIN_REGION` and at most ``most`` (default: this host's memory, what a memfd
    of snapshots could ever hold)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise SettingsError(f"{what}: give bytes, e.g. 2000000000, 512M or 2G")
    most = host_memory() if most is None else most
    amount = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(amount) or amount > most:
        raise SettingsError(f"{what}: more than this host's memory ({human(most)}); give at most "
                            f"{most}, e.g. 2G")
    value = int(amount)
    if value < MIN_REGION:
        raise SettingsError(f"{what}: at least {MIN_REGION} bytes")
    return value


def parse_every(text: str, what: str) -> int:
    try:
        n = int(str(text).strip())
    except ValueError:
        n = 0
    if n < 1:
        raise SettingsError(f"{what}: a whole number of commits, at least 1")
    return n


def host_memory() -> int:
    """This host's memory in bytes."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):  # pragma: no cover
        return 8 * 10**9


def default_memory() -> int:
    """A quarter of this host's memory: the memfd is sparse, pages are used only when written."""
    return max(MIN_REGION, host_memory() // 4)


def human(n: float) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def region_size(memory: int, local_world_size: int) -> int:
    """Bytes of the agent's memfd each local rank gets (page aligned)."""
    return max(MIN_REGION, memory // max(1, local_world_size) // PAGE * PAGE)


@dataclass(frozen=True)
class Settings:
    """The tiers a worker writes, and where."""

    tiers: tuple[str, ...] = ()
    directory: Optional[str] = None
    every: int = DEFAULT_EVERY
    regions: Optional[str] = None  # the agent's memfd, for the local tier
    region_size: int = 0
    memory: int = 0  # the node's bound, for messages
    overlap: bool = False  # copy what the optimizer owns during the next step (overlap.py)
    notify: Optional[str] = None  # the agent's pipe, poked once a slot is sealed (the peer tier)
    key: Optional[str] = None  # seals the disk tier's steps (trust.py); None: directory checks only

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    @classmethod
    def resolve(cls, env: Mapping[str, str], *, tiers: Optional[str] = None,
                directory: Optional[str] = None, every: Optional[int] = None,
                overlap: Optional[bool] = None) -> "Settings":
        """Code's arguments over the environment. ``directory`` alone means the disk tier."""
        raw = tiers if tiers is not None else env.get(ENV_TIERS, "")
        names = parse_tiers(raw, f"snapshot={raw!r}" if tiers is not None else f"{ENV_TIERS}={raw!r}") if raw else ()
        directory = directory or env.get(ENV_DIR) or None
        if directory and not names:
            names = ("disk",)
        if "disk" in names and not directory:
            raise SettingsError("the disk tier needs a directory: --snapshot-dir DIR, "
                                f"{ENV_DIR}, or State(..., snapshot_dir=DIR)")
        if every is None:
            raw_every = env.get(ENV_EVERY, "")
            every = parse_every(raw_every, f"{ENV_EVERY}={raw_every!r}") if raw_every else DEFAULT_EVERY
        elif every < 1:
            raise SettingsError(f"snapshot_every {every!r}: at least 1")
        regions = env.get(ENV_REGIONS) or None
        size = int(env.get(ENV_REGION_SIZE, "0") or 0)
        memory = int(env.get(ENV_MEMORY, "0") or 0) if (env.get(ENV_MEMORY, "") or "").isdigit() else 0
        raw_overlap = (env.get(ENV_OVERLAP, "") or "0").strip().lower()
        if raw_overlap not in ("0", "1", "true", "false", "yes", "no"):
            raise SettingsError(f"{ENV_OVERLAP}={raw_overlap!r}: use 1 (pipelined commits) or 0")
        overlap_on = overlap if overlap is not None else raw_overlap in ("1", "true", "yes")
        return cls(names, directory, every, regions, size, memory, overlap_on,
                   notify=env.get(ENV_NOTIFY) or None, key=env.get(ENV_KEY) or None)

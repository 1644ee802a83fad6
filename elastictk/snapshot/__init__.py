"""Snapshots of ``elastictk.State``: in the agent's shared memory (local) and on disk.

- :mod:`.settings` — the tiers, directory, cadence and memory bound; environment names (no torch).
- :mod:`.local` — the agent's memfd (:class:`~.local.Holder`) and a worker's region of it.
- :mod:`.dcp` — the disk tier through torch.distributed.checkpoint, read at any world size.
- :mod:`.copies` — replicated state at another world size from any node's copy in memory.
- :mod:`.reshard` — DTensors (FSDP2) as local shards in the buffer, rebuilt for DCP.
- :mod:`.codec` — a state as one flat buffer (skeleton + aligned tensor bytes).
- :mod:`.worker` — :class:`~.worker.Snapshotter`: commit to the tiers, agree, restore.

See docs/snapshots.md.
"""
from __future__ import annotations

from .settings import TIERS, Settings, SettingsError, parse_bytes, parse_every, parse_tiers

__all__ = ["TIERS", "Settings", "SettingsError", "parse_bytes", "parse_every", "parse_tiers"]

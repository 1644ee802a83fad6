"""Which nodes were marked lost, as an append-only log, so a closer reads only what is new.

Apart from the notes themselves (``lost/<node_id>``, sealed, one per node) because a closer
must know every lost node at each decision, and listing every ``lost/`` key for that grew with
the job's history at every decision of every round. The log is a counter (``lostlog``) and one
entry per mark (``lostlog/<seq>``: the node id); a closer keeps its place in it, so a decision
costs one read of the counter plus the entries added since, and each entry's note is verified
once (the note, not the log entry, is what is believed: the log only says where to look).
"""
from __future__ import annotations

from typing import Callable

from ..store import Store
from .sealed import parse_counter

COUNTER = "lostlog"
#: The most entries one decision reads (a forged counter sizes nothing past it; the rest are
#: read by the decisions after).
BATCH = 1024
_MAX_ID = 256  # bytes of a node id in an entry; longer is garbage


def log_lost(store: Store, node_id: str) -> None:
    """Append ``node_id`` to the log (after its ``lost/`` note was written)."""
    seq = store.add(COUNTER, 1)
    store.set(f"{COUNTER}/{seq}", node_id.encode()[:_MAX_ID])


class LostReader:
    """A closer's place in the log and the lost nodes it has verified so far."""

    def __init__(self) -> None:
        self.seen = 0
        self.lost: set[str] = set()

    def read(self, store: Store, verified: Callable[[str, bytes | None], bool]) -> set[str]:
        """Every node whose lost note verifies, reading only the log entries added since the
        last call (at most :data:`BATCH` of them)."""
        count = parse_counter(store.try_get(COUNTER), self.seen + BATCH)
        if count <= self.seen:
            return self.lost
        seqs = range(self.seen + 1, count + 1)
        ids = []
        for raw in store.multi_get([f"{COUNTER}/{s}" for s in seqs]):
            try:
                node_id = raw.decode("utf-8") if raw is not None and len(raw) <= _MAX_ID else ""
            except UnicodeDecodeError:
                node_id = ""
            if node_id and "/" not in node_id and node_id not in self.lost:
                ids.append(node_id)
        ids = list(dict.fromkeys(ids))
        if ids:
            keys = [f"lost/{n}" for n in ids]
            self.lost.update(n for n, k, raw in zip(ids, keys, store.multi_get(keys)) if verified(k, raw))
        self.seen = count
        return self.lost

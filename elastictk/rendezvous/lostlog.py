"""Which nodes were marked lost, as an append-only log, so a closer reads only what is new.

Apart from the notes themselves (``lost/<node_id>``, sealed, one per node) because a closer
must know every lost node at each decision, and listing every ``lost/`` key for that grew with
the job's history at every decision of every round. The log is a counter (``lostlog``) and one
entry per mark (``lostlog/<seq>``: the node id); a closer keeps its place in it, so a decision
costs one read of the counter plus the entries added since, and each entry's note is verified
once (the note, not the log entry, is what is believed: the log only says where to look).

On a store that orders key creations (etcd) the log has no counter: an entry is one key per
lost node (``lostlog/by/<node_id>``) whose create revision places it, and a reader keeps the
revision it has read up to. A shared counter there is a compare-and-set loop, and when a stalled
host makes hundreds of nodes mark their neighbours lost at once (a 1,024-node job was seen with
300 at once) they raced on it while etcd, the heartbeats with it, fell behind.
"""
from __future__ import annotations

from typing import Callable

from ..store import Store
from .sealed import parse_counter

COUNTER = "lostlog"
ENTRIES = f"{COUNTER}/by/"  # on a store with ordered creations: one key per lost node
#: The most entries one decision reads (a forged counter sizes nothing past it; the rest are
#: read by the decisions after).
BATCH = 1024
_MAX_ID = 256  # bytes of a node id in an entry; longer is garbage


def log_lost(store: Store, node_id: str) -> None:
    """Append ``node_id`` to the log (after its ``lost/`` note was written)."""
    if store.ordered_arrivals:  # one write, raced by nobody
        store.set(ENTRIES + node_id[:_MAX_ID], b"")
        return
    seq = store.add(COUNTER, 1)
    store.set(f"{COUNTER}/{seq}", node_id.encode()[:_MAX_ID])


class LostReader:
    """A closer's place in the log and the lost nodes it has verified so far."""

    def __init__(self) -> None:
        self.seen = 0  # the counter's entries read; on an ordered store, the revision read up to
        self.lost: set[str] = set()

    def read(self, store: Store, verified: Callable[[str, bytes | None], bool]) -> set[str]:
        """Every node whose lost note verifies, reading only the log entries added since the
        last call (at most :data:`BATCH` of them)."""
        if store.ordered_arrivals:
            items, self.seen = store.created_since(ENTRIES, self.seen, limit=BATCH)
            return self._verify(store, [name for name, _ in items], verified)
        count = parse_counter(store.try_get(COUNTER), self.seen + BATCH)
        if count <= self.seen:
            return self.lost
        seqs = range(self.seen + 1, count + 1)
        names = []
        for raw in store.multi_get([f"{COUNTER}/{s}" for s in seqs]):
            try:
                names.append(raw.decode("utf-8") if raw is not None and len(raw) <= _MAX_ID else "")
            except UnicodeDecodeError:
                pass
        self.seen = count
        return self._verify(store, names, verified)

    def _verify(self, store: Store, names: list[str], verified: Callable[[str, bytes | None], bool]) -> set[str]:
        """Add the named nodes whose ``lost/`` note verifies (each read once)."""
        ids = list(dict.fromkeys(n for n in names if n and "/" not in n and len(n.encode()) <= _MAX_ID
                                 and n not in self.lost))
        if ids:
            keys = [f"lost/{n}" for n in ids]
            self.lost.update(n for n, k, raw in zip(ids, keys, store.multi_get(keys)) if verified(k, raw))
        return self.lost

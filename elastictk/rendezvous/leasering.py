"""Watching the ring successors by their leases (etcd): a peer is lost when its lease ends.

On a store with lease liveness each node keeps ``hb/<node_id>`` under its lease
(:class:`~elastictk.rendezvous.liveness.Heartbeat`); etcd deletes it when the lease runs out.
A membership watch holds one watch stream per successor's key and reads nothing while nothing
happens to them. When one is touched it reads the key with its lease:

- present under a lease: alive (its owner put it back, or renewed a replaced lease);
- the ``LEFT`` mark, signed with the job's token (or any, without a token): it left;
- otherwise (deleted, or rewritten without the lease) it asks etcd whether the lease seen
  at the start still lives. A lease that lives means a stranger deleted or rewrote the key:
  not believed, the node is judged by that lease, asked every heartbeat interval until its
  owner puts the key back. A lease that is gone means the node is lost.

So a stranger without the token cannot evict a node by deleting its key or writing a mark
into it, as with counters; what it can do is revoke the lease itself (its ID is in the key's
metadata), which etcd's authentication (a user per job) is there to prevent.
"""
from __future__ import annotations

from typing import Callable

from ..store import Store
from .liveness import ALIVE, LEFT, LivenessTracker
from .records import hb_key


class LeaseRing:
    """The liveness of ``node_ids`` by their leases; :meth:`lost` is asked every interval."""

    def __init__(self, store: Store, node_ids: list[str], timeout: float) -> None:
        self._store = store
        self._ids = list(node_ids)
        got, revision = store.leased_get([hb_key(n) for n in self._ids])
        self.leases = {n: (lease if value == ALIVE else 0) for n, (value, lease) in zip(self._ids, got)}
        self._unsure = {n for n, lease in self.leases.items() if not lease}  # looked at each interval
        self._tracker = LivenessTracker(timeout)  # for a node never seen under a lease
        self._watch = store.watch_keys([hb_key(n) for n in self._ids], revision)

    def lost(self, now: float, left_is_signed: Callable[[str, bytes | None], bool] | None) -> tuple[str, str] | None:
        """``(node_id, why)`` of a lost successor, or None; no request unless a key was touched."""
        touched = {k[len("hb/"):] for k in self._watch.touched()}
        look = [n for n in self._ids if n in touched or n in self._unsure]
        if not look:
            return None
        got, _ = self._store.leased_get([hb_key(n) for n in look])
        for node_id, (value, lease) in zip(look, got):
            if value == ALIVE and lease:
                self.leases[node_id] = lease
                self._unsure.discard(node_id)
                continue
            if value is not None and value.strip() == str(LEFT).encode():
                key = f"left/{node_id}"
                if left_is_signed is None or left_is_signed(key, self._store.try_get(key)):
                    return node_id, "it left"
            known = self.leases[node_id]
            if known and self._store.lease_ttl(known) > 0:
                self._unsure.add(node_id)  # a stranger touched its key; its lease lives on
                continue
            if known:
                return node_id, "its lease expired (no keepalive within heartbeat_timeout)"
            self._unsure.add(node_id)
            self._tracker.observe(node_id, None, now)
            if self._tracker.is_dead(node_id, now):
                return node_id, f"no key under a lease for {self._tracker.silent_for(node_id, now):.1f}s"
        return None

    def close(self) -> None:
        self._watch.close()

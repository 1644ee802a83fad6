"""Liveness by lease on etcd: a node is alive while the key it keeps under its lease exists.

Apart from :mod:`elastictk.store.etcd_leased` (arrivals, the closer) because this is the
other half of what etcd recommends for membership: a heartbeat counter bumped every interval
is a replicated write (a Raft entry) per node per second, which 1,024 nodes sharing an etcd
server cannot sustain; a lease keepalive is not replicated. So on etcd a node puts one key
under its lease once, renews the lease, and its peers learn of its loss from a watch event
when etcd deletes the key (the lease ran out): no counter, no polling.

- :meth:`AliveOps.leased_get`: keys' values with the lease each is attached to (0: none), one
  read; a key rewritten without the lease (a stranger's ``set``) shows lease 0.
- :meth:`AliveOps.lease_ttl`: a lease's remaining time (< 0: gone), so an observer can tell
  "the key was deleted because the lease ended" from "someone deleted or rewrote the key".
- :meth:`AliveOps.watch_keys`: one long-lived watch stream per key, asked without blocking
  ("did anything happen to these keys?") at no request per ask.
"""
from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Sequence

from .base import Deadline
from .etcd_http import GRPC_NOT_FOUND, JSON, EtcdApiError, b64, unb64

if TYPE_CHECKING:
    from .etcd_http import EtcdTransport

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops: the most operations one transaction may hold
STOP_EVERY = 0.5  # the longest a blocking ask sits in one select (it is asked again after)


class AliveOps:
    """The lease-liveness methods of :class:`~elastictk.store.etcd.EtcdStore` (a mixin)."""

    if TYPE_CHECKING:  # what EtcdStore provides
        _t: EtcdTransport

        def _k(self, key: str) -> bytes: ...
        def _call(self, path: str, body: JSON, *, timeout: float | None = None,
                  retry_sent: bool = True) -> JSON: ...

    lease_liveness = True

    def leased_get(self, keys: Sequence[str]) -> tuple[list[tuple[bytes | None, int]], int]:
        """``(value, lease)`` of each key (``(None, 0)`` when absent) read in one transaction,
        and the revision read at (a watch from the next one misses nothing)."""
        out: list[tuple[bytes | None, int]] = []
        rev = 0
        for i in range(0, len(keys), MAX_TXN_OPS):  # etcd refuses a larger transaction
            at = {"revision": str(rev)} if rev else {}  # later chunks read the first's snapshot
            ops = [{"request_range": {"key": b64(self._k(k)), **at}} for k in keys[i:i + MAX_TXN_OPS]]
            r = self._call("/v3/kv/txn", {"success": ops})
            rev = rev or int(r["header"]["revision"])
            for resp in r.get("responses") or ():
                kvs = (resp.get("response_range") or {}).get("kvs") or ()
                out.append((unb64(kvs[0].get("value")), int(kvs[0].get("lease", 0) or 0)) if kvs else (None, 0))
        return out, rev

    def lease_ttl(self, lease_id: int) -> float:
        """Seconds the lease has left; -1 when it expired or was revoked."""
        try:
            r = self._call("/v3/lease/timetolive", {"ID": str(lease_id)})
        except EtcdApiError as e:
            if e.code == GRPC_NOT_FOUND:
                return -1.0
            raise
        return float(r.get("TTL", -1))

    def watch_keys(self, keys: Sequence[str], revision: int) -> "KeyWatch":
        return KeyWatch(self, keys, revision)


class KeyWatch:
    """One watch stream per key from ``revision + 1`` on, opened at the first ask and kept open:
    :meth:`touched` says, without blocking and without a request, which keys had an event
    (put or delete) since it was last asked. A broken stream is opened again from the
    revision after its last event, so nothing in between is missed."""

    def __init__(self, store: AliveOps, keys: Sequence[str], revision: int) -> None:
        self._store = store
        self._start = {k: revision + 1 for k in keys}
        self._streams: dict[str, Any] = {}  # opened on the first ask: a failed open leaks none

    def _open(self, key: str) -> None:
        body = json.dumps({"create_request": {"key": b64(self._store._k(key)),
                                              "start_revision": str(self._start[key])}})
        self._streams[key] = self._store._t.stream("/v3/watch", body.encode(), timeout=5.0)

    def touched(self, timeout: float = 0.0) -> set[str]:
        """Keys with an event since the last ask; with ``timeout``, waits up to it for one."""
        deadline = Deadline(timeout)
        out = self._drain()
        while not out and (left := deadline.remaining() or 0.0) > 0:
            streams = list(self._streams.values())
            if len(streams) == 1:
                streams[0].ready(min(left, STOP_EVERY))
            else:
                time.sleep(min(left, 0.05))
            out = self._drain()
        return out

    def _drain(self) -> set[str]:
        out: set[str] = set()
        for key in list(self._start):
            stream = self._streams.get(key)
            if stream is None:
                self._open(key)
                stream = self._streams[key]
            while stream.ready(0.0):
                try:
                    result = stream.next(5.0)
                except TimeoutError:
                    result = None
                if result is None or result.get("canceled"):
                    stream.close()
                    self._streams.pop(key, None)
                    out.add(key)  # unsure what happened meanwhile: the caller looks
                    break
                for event in result.get("events") or ():
                    kv = event.get("kv") or {}
                    self._start[key] = max(self._start[key], int(kv.get("mod_revision", 0)) + 1)
                    out.add(key)
        return out

    def close(self) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.close()

"""etcd's leases and lease-ordered arrivals: keys that die with their owner, ordered by etcd.

Apart from :mod:`elastictk.store.etcd` (the :class:`~elastictk.store.base.Store` primitives)
because this is what only etcd offers, used as etcd recommends for a membership round:

- a joiner's arrival is one key under its own lease, created in one transaction that also
  checks the round is still open and elects the round's closer (create-if-absent), so K
  joiners cost K transactions, never a race on a shared counter;
- arrivals are ordered by the revision that created them (``created_since`` reads only the
  ones after a revision: the closer reads each arrival once);
- a waiter reads its own key once and then holds one watch stream on that key until it is
  written, looking at a stop flag every half second without ending the stream;
- a dead node's keys vanish when its lease runs out (nobody has to judge a counter).
"""
from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .base import Deadline, StoreError
from .etcd_http import GRPC_NOT_FOUND, JSON, EtcdApiError, b64, unb64

if TYPE_CHECKING:
    from .etcd_http import EtcdTransport

STOP_EVERY = 0.5  # how often a waiter looks at its stop flag (the stream stays open)


class LeaseExpired(StoreError):
    """The lease is gone (expired or revoked); the keys attached to it were deleted."""


def range_end(prefix: bytes) -> bytes:
    """The first key after all keys that start with ``prefix`` (etcd's prefix-range rule)."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"  # with key b"\0": every key


def _absent(key: str) -> JSON:
    return {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


class LeasedOps:
    """The lease and ordered-arrival methods of :class:`~elastictk.store.etcd.EtcdStore` (a mixin)."""

    if TYPE_CHECKING:  # what EtcdStore provides
        _t: EtcdTransport
        _prefix: bytes

        def _k(self, key: str) -> bytes: ...
        def _call(self, path: str, body: JSON, *, timeout: float | None = None,
                  retry_sent: bool = True) -> JSON: ...
        def describe(self) -> str: ...

    ordered_arrivals = True

    # -- leases ----------------------------------------------------------------------------------
    def grant_lease(self, ttl: float) -> int:
        """A new lease living ``ttl`` seconds (rounded up; etcd may raise it to its minimum).

        The owner calls :meth:`keepalive` well within ``ttl`` (say every ``ttl / 3``) from
        its heartbeat thread, on a :meth:`clone`; if the owner dies, etcd deletes every key
        attached to the lease once ``ttl`` passes.
        """
        r = self._call("/v3/lease/grant", {"TTL": str(max(1, math.ceil(ttl)))})
        if r.get("error"):
            raise StoreError(f"etcd at {self.describe()} refused a lease: {r['error']}")
        return int(r["ID"])

    def set_with_lease(self, key: str, value: bytes, lease_id: int) -> None:
        """``set`` whose key is deleted when the lease expires or is revoked."""
        self._leased_call(lease_id, "/v3/kv/put", {
            "key": b64(self._k(key)), "value": b64(value), "lease": str(lease_id),
        })

    def keepalive(self, lease_id: int) -> float:
        """Renew the lease; its TTL in seconds. :class:`LeaseExpired` if it is already gone."""
        r = self._call("/v3/lease/keepalive", {"ID": str(lease_id)})
        if isinstance(r.get("error"), dict):  # an error inside the keepalive stream
            message = r["error"].get("message") or r["error"]
            raise StoreError(
                f"keepalive of lease {lease_id:x} on {self.describe()} failed: {message}"
            )
        result = r.get("result", r)
        if not isinstance(result, dict) or int(result.get("TTL", 0)) <= 0:
            raise self._lease_gone(lease_id)
        return float(result["TTL"])

    def revoke(self, lease_id: int) -> bool:
        """End the lease now, deleting its keys; whether it still existed."""
        try:
            self._call("/v3/lease/revoke", {"ID": str(lease_id)})
        except EtcdApiError as e:
            if e.code == GRPC_NOT_FOUND:
                return False
            raise
        return True

    def _lease_gone(self, lease_id: int) -> LeaseExpired:
        return LeaseExpired(
            f"lease {lease_id:x} on {self.describe()} expired or was revoked, so its keys are "
            "gone; grant a new lease, re-create the keys and renew it more often than its TTL"
        )

    def _leased_call(self, lease_id: int, path: str, body: JSON) -> JSON:
        try:
            return self._call(path, body, retry_sent=False)
        except EtcdApiError as e:
            if e.code == GRPC_NOT_FOUND:
                raise self._lease_gone(lease_id) from None
            raise

    # -- ordered arrivals ------------------------------------------------------------------------
    def arrive(self, key: str, value: bytes, lease: int, *, unless: Sequence[str] = (),
               claim: tuple[str, bytes] | None = None) -> tuple[bool, bool]:
        """One transaction: unless an ``unless`` key exists, put ``key`` under ``lease`` and
        create ``claim`` if absent (a nested transaction); ``(arrived, claimed)``."""
        k = b64(self._k(key))
        ops: list[JSON] = [{"request_put": {"key": k, "value": b64(value), "lease": str(lease)}}]
        if claim is not None:
            c = b64(self._k(claim[0]))
            ops.append({"request_txn": {
                "compare": [_absent(c)],
                "success": [{"request_put": {"key": c, "value": b64(claim[1]), "lease": str(lease)}}],
            }})
        r = self._leased_call(lease, "/v3/kv/txn", {
            "compare": [_absent(b64(self._k(u))) for u in unless], "success": ops,
        })
        if not r.get("succeeded"):
            return False, False
        claimed = claim is not None and bool(((r.get("responses") or [{}, {}])[1].get("response_txn") or {})
                                             .get("succeeded"))
        return True, claimed

    def claim(self, key: str, value: bytes, lease: int) -> bool:
        k = b64(self._k(key))
        r = self._leased_call(lease, "/v3/kv/txn", {
            "compare": [_absent(k)],
            "success": [{"request_put": {"key": k, "value": b64(value), "lease": str(lease)}}],
        })
        return bool(r.get("succeeded"))

    def created_since(self, prefix: str, revision: int, limit: int = 0) -> tuple[list[tuple[str, bytes]], int]:
        full = self._k(prefix)
        r = self._call("/v3/kv/range", {
            "key": b64(full), "range_end": b64(range_end(full)), "sort_order": "ASCEND",
            "sort_target": "CREATE", "min_create_revision": str(revision + 1),
            **({"limit": str(limit)} if limit > 0 else {}),
        })
        out, last = [], revision
        for kv in r.get("kvs") or ():
            out.append((unb64(kv.get("key"))[len(full):].decode("utf-8", "surrogateescape"),
                        unb64(kv.get("value"))))
            last = max(last, int(kv.get("create_revision", 0)))
        return out, last

    def watch_created(self, prefix: str, revision: int) -> "CreationWatch":
        return CreationWatch(self, prefix, revision)

    def count(self, prefix: str) -> int:
        full = self._k(prefix)
        r = self._call("/v3/kv/range", {"key": b64(full), "range_end": b64(range_end(full)),
                                        "count_only": True})
        return int(r.get("count", 0))

    def wait_created(self, prefix: str, revision: int, count: int, timeout: float) -> bool:
        full = self._k(prefix)
        seen = 0

        def created(event: JSON) -> bool:
            nonlocal seen
            kv = event.get("kv") or {}
            if event.get("type") != "DELETE" and int(kv.get("create_revision", 0)) > revision \
                    and kv.get("version") in ("1", 1):
                seen += 1
            return seen >= count

        watched = {"key": b64(full), "range_end": b64(range_end(full))}
        return self._watch(watched, revision + 1, created, Deadline(timeout), None) is not None

    def await_value(self, key: str, timeout: float,
                    stop: Callable[[], bool] | None = None) -> bytes | None:
        full = self._k(key)
        r = self._call("/v3/kv/range", {"key": b64(full)})
        kvs = r.get("kvs")
        if kvs:
            return unb64(kvs[0].get("value"))
        rev = int(r["header"]["revision"])
        got: list[bytes] = []

        def written(event: JSON) -> bool:
            if event.get("type") == "DELETE":
                return False
            got.append(unb64((event.get("kv") or {}).get("value")))
            return True

        if self._watch({"key": b64(full)}, rev + 1, written, Deadline(timeout), stop) is None:
            return None
        return got[-1] if got else None

    def _watch(self, watched: JSON, start: int, done: Callable[[JSON], bool], deadline: Deadline,
               stop: Callable[[], bool] | None) -> Any:
        """One watch stream from revision ``start`` until ``done(event)`` (True), the deadline
        or ``stop()`` (None). A broken stream (failover, compaction) is opened again from the
        revision after the last event seen, so nothing in between is missed."""
        while True:
            if deadline.expired() or (stop is not None and stop()):
                return None
            body = json.dumps({"create_request": {**watched, "start_revision": str(start)}})
            try:
                stream = self._t.stream("/v3/watch", body.encode(), timeout=max(deadline.remaining() or 0.0, 1.0))
            except StoreError:
                if deadline.expired():
                    return None
                raise
            try:
                while True:
                    left = deadline.remaining() or 0.0
                    if left <= 0 or (stop is not None and stop()):
                        return None
                    if not stream.ready(min(left, STOP_EVERY)):
                        continue
                    try:
                        result = stream.next(max(left, 1.0))
                    except TimeoutError:
                        break
                    if result is None or result.get("canceled"):
                        compacted = int(result.get("compact_revision", 0) or 0) if result else 0
                        start = max(start, compacted)
                        break
                    for event in result.get("events") or ():
                        start = max(start, int((event.get("kv") or {}).get("mod_revision", 0)) + 1)
                        if done(event):
                            return True
            finally:
                stream.close()


class CreationWatch:
    """One long-lived watch stream on the keys under a prefix, for a thread that asks again and
    again whether one was created (a membership watch, once per heartbeat interval): the
    stream stays open between the asks, so the ask costs no request; it is opened again,
    from the revision after the last event seen, only when it broke."""

    def __init__(self, store: LeasedOps, prefix: str, revision: int) -> None:
        self._store = store
        self._full = store._k(prefix)
        self._start = revision + 1
        self._stream: Any = None

    def wait(self, timeout: float) -> bool:
        """Whether a key was created under the prefix (since the last True, or the revision
        given) within ``timeout``."""
        deadline = Deadline(timeout)
        while True:
            left = deadline.remaining() or 0.0
            if left <= 0:
                return False
            if self._stream is None:
                body = json.dumps({"create_request": {"key": b64(self._full), "range_end": b64(range_end(self._full)),
                                                      "start_revision": str(self._start)}})
                self._stream = self._store._t.stream("/v3/watch", body.encode(), timeout=max(left, 1.0))
            stream = self._stream
            if not stream.ready(min(left, STOP_EVERY)):
                continue
            try:
                result = stream.next(max(left, 1.0))
            except TimeoutError:
                result = None
            if result is None or result.get("canceled"):
                self.close()
                continue
            created = False
            for event in result.get("events") or ():
                kv = event.get("kv") or {}
                self._start = max(self._start, int(kv.get("mod_revision", 0)) + 1)
                created = created or (event.get("type") != "DELETE" and kv.get("version") in ("1", 1))
            if created:
                return True

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

"""etcd v3 behind elastictk's :class:`Store` interface: the store that outlives any one host.

A TCPStore lives inside one agent process, so losing that host loses the job's rendezvous.
etcd replicates every write across its members; with several endpoints an ``EtcdStore`` fails
over to the next member when one goes away, and a restarted etcd keeps its data.

How the primitives map onto etcd:

- ``add`` reads the counter, then writes ``old + amount`` in a transaction that only succeeds
  if the key's ``mod_revision`` is still the one read; a lost race returns the fresh value in
  the same round trip and the loop tries again after a randomised pause that doubles per lost
  race (:class:`~elastictk.store.base.Backoff`), so K racing writers do not cost K**2/2
  transactions. ``add(key, 0)`` of a counter that exists is one plain read (no write, no race).
- ``compare_set`` is one transaction (a nested one for ``expected=None``, which must match both
  an absent key and an empty value, something a single etcd comparison cannot express).
- ``wait``/``get`` read the keys once (one snapshot) and, if some are missing, watch them from
  the revision right after that read, so no write in between is missed and nothing polls.
- Leases and lease-ordered arrivals (:mod:`elastictk.store.etcd_leased`) make keys die with
  their owner and let a round's joiners arrive without a shared counter. They are the optional
  part of the :class:`Store` interface (``ordered_arrivals``): the other backends have no
  server-side expiry or creation order to offer, and join through a counter at no more cost.

TLS: ``https://`` endpoints, or an :class:`ssl.SSLContext` from :func:`tls_context` (the CA that
signed etcd's certificate, and the client certificate and key when etcd runs with
``--client-cert-auth``), make every connection HTTPS.
"""
from __future__ import annotations

import json
import re
import ssl
import time
from typing import Callable, Iterable, Sequence

from .base import (
    DEFAULT_TIMEOUT,
    Backoff,
    Deadline,
    Store,
    StoreError,
    StoreTimeout,
    StoreUnreachable,
)
from .endpoint import Endpoint, EndpointError
from .etcd_endpoints import (  # noqa: F401 - re-exported: where callers import them from
    ETCD_DEFAULT_PORT, SCHEMES, parse_endpoints, parse_endpoints_and_scheme, split_scheme, tls_context,
)
from .etcd_http import JSON, EtcdTransport, b64, unb64
from .etcd_alive import MAX_TXN_OPS, AliveOps  # noqa: F401 - MAX_TXN_OPS re-exported
from .etcd_leased import LeasedOps, LeaseExpired, range_end  # noqa: F401 - LeaseExpired re-exported

_REWATCH_PAUSE = 0.05  # after a watch stream broke, before reading again (no tight loop)
_COUNTER = re.compile(rb"-?[0-9]+")

Values = dict[bytes, bytes]


def _first_value(range_response: JSON) -> bytes | None:
    kvs = range_response.get("kvs")
    return unb64(kvs[0].get("value")) if kvs else None


def _value_and_revision(range_response: JSON) -> tuple[bytes | None, str]:
    """The value and ``mod_revision`` of a one-key range; an absent key has revision 0."""
    kvs = range_response.get("kvs")
    return (unb64(kvs[0].get("value")), kvs[0]["mod_revision"]) if kvs else (None, "0")


class EtcdStore(AliveOps, LeasedOps, Store):
    """A client of an etcd v3 cluster; keys live under ``prefix`` (``"job1"`` -> ``job1/...``).

    ``tls`` (see :func:`tls_context`) or ``https://`` endpoints talk to etcd over TLS.

    Fails within ``timeout`` with :class:`StoreUnreachable`, one line naming each endpoint and
    what went wrong there, when no endpoint serves etcd's v3 API.

    Beyond what the ABC promises, one object may be shared by threads: unary calls take turns on
    one keep-alive connection and every wait opens a watch connection of its own.
    """

    def __init__(
        self,
        endpoints: str | Endpoint | Sequence[str | Endpoint],
        *,
        prefix: str = "",
        timeout: float = DEFAULT_TIMEOUT,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.endpoints, scheme = parse_endpoints_and_scheme(endpoints)
        if scheme == "http" and tls is not None:
            raise EndpointError(
                "http:// etcd endpoints with a TLS context: write them as https:// (or leave "
                "the scheme out)"
            )
        if scheme == "https" and tls is None:
            tls = ssl.create_default_context()  # the system's CAs, no client certificate
        self.tls = tls
        self.prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        self._prefix = self.prefix.encode("utf-8", "surrogateescape")
        self.default_timeout = timeout
        self._t = EtcdTransport(self.endpoints, timeout, tls)
        # Fail at construction, like TCPStore.connect, not at the first use far from the cause.
        try:
            self._t.call("/v3/kv/range", {"key": b64(b"\0"), "keys_only": True, "limit": "1"})
        except BaseException:
            self._t.close()
            raise

    # -- helpers -----------------------------------------------------------------------------
    def _k(self, key: str) -> bytes:
        return self._prefix + key.encode("utf-8", "surrogateescape")

    def _call(self, path: str, body: JSON, *, timeout: float | None = None,
              retry_sent: bool = True) -> JSON:
        return self._t.call(path, body, timeout=timeout, retry_sent=retry_sent)

    def _read(self, keys: list[bytes], timeout: float | None = None) -> tuple[Values, int]:
        """The present keys' values and the revision they were read at (one snapshot)."""
        values: Values = {}
        rev = 0
        for i in range(0, len(keys), MAX_TXN_OPS):
            chunk = keys[i:i + MAX_TXN_OPS]
            at = {"revision": str(rev)} if rev else {}  # later chunks read the first's snapshot
            ops = [{"request_range": {"key": b64(k), **at}} for k in chunk]
            r = self._call("/v3/kv/txn", {"success": ops}, timeout=timeout)
            rev = rev or int(r["header"]["revision"])
            for k, resp in zip(chunk, r.get("responses") or ()):
                value = _first_value(resp.get("response_range") or {})
                if value is not None:
                    values[k] = value
        return values, rev

    def _watch_until(self, keys: list[bytes], done: Callable[[Values], bool],
                     deadline: Deadline) -> tuple[bool, Values]:
        """Track ``keys`` until ``done(values)`` holds; ``(False, values)`` past the deadline."""
        wanted = set(keys)
        # One watch over the smallest key range holding them all, filtered here: the gateway
        # reliably takes only the first watch request of a stream (it reads the rest of the
        # request body while already answering, which Go's HTTP/1 server does not allow).
        lo, hi = min(wanted), max(wanted)
        watched = {"key": b64(lo)} if lo == hi else {"key": b64(lo), "range_end": b64(hi + b"\0")}
        values: Values = {}
        while True:
            # The read itself gets at least a second, so a short wait on a busy server reports
            # a timeout (or a dead server) rather than a failed read.
            left = deadline.remaining() or 0.0
            try:
                values, rev = self._read(keys, timeout=max(left, min(1.0, self.default_timeout)))
            except StoreUnreachable as e:
                # A read that got no answer before this wait's own deadline is this wait timing
                # out on a busy server, not a lost store (a refused endpoint still raises).
                if getattr(e, "no_answer", False) and deadline.expired():
                    return False, values
                raise
            if done(values):
                return True, values
            if deadline.expired():
                return False, values
            body = json.dumps({"create_request": {**watched, "start_revision": str(rev + 1)}})
            try:
                stream = self._t.stream(
                    "/v3/watch", body.encode(), timeout=deadline.remaining() or 0.0
                )
            except StoreUnreachable:
                if deadline.expired():
                    return False, values
                raise
            try:
                while True:
                    left = deadline.remaining() or 0.0
                    if left <= 0:
                        return False, values
                    try:
                        result = stream.next(left)
                    except TimeoutError:
                        return False, values
                    if result is None or result.get("canceled"):
                        break  # server gone, failover or compaction: read again, watch again
                    for event in result.get("events") or ():
                        kv = event.get("kv") or {}
                        key = unb64(kv.get("key"))
                        if key not in wanted:
                            continue
                        if event.get("type") == "DELETE":
                            values.pop(key, None)
                        else:
                            values[key] = unb64(kv.get("value"))
                    if done(values):
                        return True, values
            finally:
                stream.close()
            time.sleep(min(_REWATCH_PAUSE, deadline.remaining() or 0.0))

    # -- the Store primitives ----------------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        self._call("/v3/kv/put", {"key": b64(self._k(key)), "value": b64(value)})

    def try_get(self, key: str) -> bytes | None:
        return _first_value(self._call("/v3/kv/range", {"key": b64(self._k(key))}))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        t = self._timeout(timeout)
        full = self._k(key)
        ok, values = self._watch_until([full], lambda v: full in v, Deadline(t))
        if not ok:
            raise self._timeout_error([key], t)
        return values[full]

    def multi_get(self, keys: Iterable[str]) -> list[bytes | None]:
        full = [self._k(k) for k in keys]
        if not full:
            return []
        values, _ = self._read(list(dict.fromkeys(full)))
        return [values.get(k) for k in full]

    def multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Puts in transactions of at most :data:`MAX_TXN_OPS` (etcd's --max-txn-ops)."""
        items = list(dict(items).items())  # one put per key (etcd refuses a txn naming a key twice)
        for i in range(0, len(items), MAX_TXN_OPS):
            ops = [{"request_put": {"key": b64(self._k(k)), "value": b64(v)}} for k, v in items[i:i + MAX_TXN_OPS]]
            self._call("/v3/kv/txn", {"success": ops})

    def _counter(self, key: str, value: bytes | None) -> int:
        if value is None:
            return 0
        if not _COUNTER.fullmatch(value):
            raise StoreError(
                f"key {key!r} in {self.describe()} holds {value[:32]!r}, not a decimal counter; "
                "add() needs a key that only add() writes"
            )
        return int(value)

    def add(self, key: str, amount: int) -> int:
        full = b64(self._k(key))
        deadline = Deadline(self.default_timeout)
        r = self._call("/v3/kv/range", {"key": full})
        value, mod = _value_and_revision(r)
        if amount == 0 and value is not None:  # a read: no write, no race with the counter's writers
            return self._counter(key, value)
        if amount == 0:  # absent: created as "0" (as every backend does) unless another made it first
            r = self._call("/v3/kv/txn", {
                "compare": [{"key": full, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                "success": [{"request_put": {"key": full, "value": b64(b"0")}}],
                "failure": [{"request_range": {"key": full}}],
            })
            if r.get("succeeded"):
                return 0
            return self._counter(key, _first_value(r["responses"][0].get("response_range") or {}))
        pause = Backoff()
        while True:
            new = self._counter(key, value) + amount
            r = self._call("/v3/kv/txn", {
                "compare": [{"key": full, "target": "MOD", "result": "EQUAL", "mod_revision": mod}],
                "success": [{"request_put": {"key": full, "value": b64(str(new).encode())}}],
                "failure": [{"request_range": {"key": full}}],
            }, retry_sent=False)
            if r.get("succeeded"):
                return new
            if deadline.expired():
                raise StoreError(
                    f"add({key!r}) on {self.describe()} lost every race for "
                    f"{self.default_timeout:g}s; too many writers on one counter?"
                )
            value, mod = _value_and_revision(r["responses"][0].get("response_range") or {})
            pause.sleep(deadline)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes | None:
        k = b64(self._k(key))
        put = {"request_put": {"key": k, "value": b64(desired)}}
        read = {"request_range": {"key": k}}
        if expected:
            body: JSON = {
                "compare": [
                    {"key": k, "target": "VALUE", "result": "EQUAL", "value": b64(expected)}
                ],
                "success": [put], "failure": [read],
            }
        else:  # absent (create_revision 0) or, failing that, empty
            body = {
                "compare": [
                    {"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
                ],
                "success": [put],
                "failure": [{"request_txn": {
                    "compare": [{"key": k, "target": "VALUE", "result": "EQUAL", "value": ""}],
                    "success": [put], "failure": [read],
                }}],
            }
        r = self._call("/v3/kv/txn", body, retry_sent=False)
        if r.get("succeeded"):
            return desired
        resp = r["responses"][0]
        if "response_txn" in resp:
            inner = resp["response_txn"]
            if inner.get("succeeded"):
                return desired
            resp = inner["responses"][0]
        return _first_value(resp.get("response_range") or {})

    def delete(self, key: str) -> bool:
        r = self._call("/v3/kv/deleterange", {"key": b64(self._k(key))})
        return int(r.get("deleted", 0)) > 0

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        t = self._timeout(timeout)
        full = {self._k(k): k for k in keys}
        if not full:
            return
        ok, values = self._watch_until(list(full), lambda v: len(v) == len(full), Deadline(t))
        if not ok:  # name the keys still missing, not the first ones asked for
            raise self._timeout_error([k for f, k in full.items() if f not in values], t)

    def wait_absent(self, keys: Sequence[str], timeout: float | None = None) -> None:
        """Block until none of ``keys`` exists (e.g. a dead owner's leased key expired)."""
        t = self._timeout(timeout)
        full = list(dict.fromkeys(self._k(k) for k in keys))
        if full and not self._watch_until(full, lambda v: not v, Deadline(t))[0]:
            shown = ", ".join(repr(k) for k in list(keys)[:5])
            raise StoreTimeout(
                f"timed out after {t:g}s waiting for key(s) {shown} to disappear from "
                f"{self.describe()}; their owner may still be alive and renewing its lease"
            )

    def keys(self, prefix: str = "") -> list[str]:
        full = self._k(prefix)
        r = self._call("/v3/kv/range", {
            "key": b64(full or b"\0"), "range_end": b64(range_end(full)), "keys_only": True,
        })
        n = len(self._prefix)
        return [
            unb64(kv.get("key"))[n:].decode("utf-8", "surrogateescape")
            for kv in r.get("kvs") or ()
        ]

    # -- lifetime ------------------------------------------------------------------------------
    @property
    def requests(self) -> int:
        """How many calls and watch streams this object has made (to tell waiting from polling)."""
        return self._t.requests

    def clone(self) -> "EtcdStore":
        return EtcdStore(self.endpoints, prefix=self.prefix, timeout=self.default_timeout,
                         tls=self.tls)

    def close(self) -> None:
        self._t.close()

    def describe(self) -> str:
        return self._t.describe()

    def __repr__(self) -> str:
        return f"EtcdStore({self.describe()!r}, prefix={self.prefix!r})"

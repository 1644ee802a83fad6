"""The one place that writes and reads every record that can change what a node does.

Joins, round results, failure notes, lost/left/shutdown notes, exit-barrier marks, the
job-wide restart state, decisions, ``master``, and the in-place host and setup records all go
through :class:`Records`. With a job token each carries a MAC over the job id, the run's
nonce, its full store key and its JSON (:class:`~elastictk.rendezvous.auth.Signer`), and a
value that does not verify is treated as **absent**: it never ends or stops a wait, never wins
a compare-and-set (:meth:`Records.claim` replaces such bytes), never counts as a failure.

Wire format of a sealed record (UTF-8 JSON, keys sorted, no spaces)::

    {"<field>": <value>, ..., "mac": "<64 hex digits>"}

    mac = HMAC-SHA256(token, b"elastictk-seal/1" + b"\\n" + job_id + b"\\n" + run + b"\\n"
                             + full store key + b"\\n" + canonical JSON of the fields)

where ``run`` is the run's nonce (32 hex digits, in the job's ``auth`` record, which is
itself sealed with ``run`` empty) and the canonical JSON is the record without ``mac``,
keys sorted, separators ``,``/``:``: the record's own bytes with the ``"mac":"<hex>"``
member (and one comma beside it) cut out. So a reader checks the MAC over the raw bytes
before any parser sees them (:meth:`~elastictk.rendezvous.auth.Signer.verify_raw`), then
parses (:mod:`elastictk._safejson`: at most :data:`~elastictk._safejson.MAX_RECORD_BYTES`,
nesting, NaN/Infinity refused) and checks the parsed record's MAC again. A value larger,
nested deeper, garbled or wrongly typed is absent like a forged one. Without a token the
same JSON has no ``mac`` and is believed as is (as torchrun believes its store); bytes that
are not a JSON object (by the same safe parser) are then an error naming the key, except
where a watch thread reads them (it logs and wakes the agent, or ignores them).
"""
from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any, Callable

from .._safejson import Unreadable, loads_object
from ..store import Store, StoreError, StoreTimeout
from ..store.base import Backoff, KeysWatch
from .auth import MAC_FIELD, Signer
from .errors import RendezvousStateError

log = logging.getLogger("elastictk.rendezvous")

_CAS_TRIES = 100


def new_run_nonce() -> str:
    """A fresh run identity: 128 random bits."""
    return secrets.token_hex(16)


def derive_key(signer: Signer, purpose: str) -> str | None:
    """A key for ``purpose`` derived from the job's token and this run's nonce (and job id):
    ``HMAC-SHA256(token, ...)`` over a name no record has, so it is no record's MAC and
    reveals nothing of the token. Handed to those that must not get the token itself (the
    in-place workers). None without a token."""
    if not signer.enabled:
        return None
    return signer.mac(f"derived-key:{purpose}", {"purpose": purpose})


def parse_counter(raw: bytes | None, upper: int) -> int:
    """A counter read from the store (``None``: absent), clamped to ``0..upper``: anyone can
    write a counter, so what it says never sizes more than ``upper`` of anything. Bytes that
    are not a decimal integer read as 0."""
    if raw is None:
        return 0
    try:
        value = int(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return 0
    return max(0, min(value, upper))


class Records:
    """The sealed records of one store under one key prefix (what MACs and errors name)."""

    def __init__(self, store: Store, prefix: str, signer: Signer,
                 _warned: set[str] | None = None) -> None:
        self.store = store
        self.prefix = prefix
        self.signer = signer
        self._warned = set() if _warned is None else _warned

    def view(self, store: Store, prefix: str) -> "Records":
        """The same run's records in another store or under another prefix."""
        return Records(store, prefix, self.signer, self._warned)

    def name(self, key: str) -> str:
        """The full store key: what a record's MAC covers and what errors name."""
        return f"{self.prefix}/{key}" if self.prefix else key

    # -- bytes ------------------------------------------------------------------------------
    def seal(self, key: str, body: dict[str, Any]) -> bytes:
        return json.dumps(self.signer.seal(self.name(key), body), separators=(",", ":"),
                          sort_keys=True).encode()

    def open(self, key: str, raw: bytes | None) -> dict[str, Any] | None:
        """The record in ``raw`` for ``key`` without its MAC; None when absent or (with a token)
        when it does not verify. Without a token, bytes that are not a JSON object raise
        :class:`RendezvousStateError` naming the key."""
        if raw is None:
            return None
        raw = bytes(raw)
        if self.signer.enabled and not self.signer.verify_raw(self.name(key), raw):
            self.ignored(key, f"{len(raw)} bytes not signed with this job's rendezvous token for this "
                         "run (forged, replayed, garbled, or written by a node with another --rdzv-token)")
            return None
        try:
            data = loads_object(raw)
        except Unreadable as e:
            if self.signer.enabled:
                self.ignored(key, f"{len(raw)} bytes that are not a sealed JSON record: {e}")
                return None
            raise RendezvousStateError(
                f"store key {self.name(key)!r} holds {len(raw)} bytes that are not a JSON record ({e}); "
                "another program shares this store and job id: use a fresh --rdzv-id or clear the store"
            ) from None
        if not self.signer.verify(self.name(key), data):
            self.ignored(key, "not signed with this job's rendezvous token for this run (forged, "
                         "replayed, or written by a node with another --rdzv-token)")
            return None
        return {k: v for k, v in data.items() if k != MAC_FIELD}

    def trusted(self, key: str, raw: bytes | None) -> bool:
        """Whether ``raw`` is a record of this run for ``key`` (never raises)."""
        try:
            return self.open(key, raw) is not None
        except RendezvousStateError:
            return False

    def ignored(self, key: str, why: str) -> None:
        """Warn, once per key, that a value was not believed."""
        name = self.name(key)
        if name not in self._warned:
            self._warned.add(name)
            log.warning("ignored store key %r: %s", name, why)

    # -- store operations -------------------------------------------------------------------
    def read(self, key: str) -> dict[str, Any] | None:
        return self.open(key, self.store.try_get(key))

    def write(self, key: str, body: dict[str, Any]) -> bytes:
        raw = self.seal(key, body)
        self.store.set(key, raw)
        return raw

    def claim(self, key: str, body: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        """Compare-and-set ``body`` into an absent ``key``: (whether we won, the record there
        now). Bytes that do not verify (or are not JSON) count as absent and are replaced."""
        mine = self.seal(key, body)
        pause = Backoff()
        for _ in range(_CAS_TRIES):
            raw = self.store.try_get(key)
            if raw is not None:
                try:
                    current = self.open(key, raw)
                except RendezvousStateError:
                    current = None  # garbage (no token): replaced, as absent
                if current is not None:
                    return raw == mine, current
            got = self.store.compare_set(key, raw, mine)
            if got == mine:
                return True, dict(body)
            pause.sleep()  # another writer won this try: let the racers spread out
        raise StoreError(f"store key {self.name(key)!r}: {_CAS_TRIES} compare-and-set conflicts")

    def replace(self, key: str, expected: bytes | None, body: dict[str, Any]) -> bool:
        """Compare-and-set ``body`` over exactly ``expected`` (None: absent); whether it won."""
        mine = self.seal(key, body)
        return self.store.compare_set(key, expected, mine) == mine

    def wait(self, key: str, timeout: float, poll: float = 0.25,
             stop: Callable[[], bool] | None = None) -> dict[str, Any] | None:
        """Block until ``key`` holds a record that verifies; None after ``timeout``, or as soon
        as ``stop()`` is true (checked every half second). A value that does not verify is
        waited past, as if absent."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            raw = self.store.try_get(key)
            record = self.open(key, raw)
            if record is not None:
                return record
            left = deadline - time.monotonic()
            if left <= 0 or (stop is not None and stop()):
                return None
            if raw is None:
                try:
                    self.store.wait([key], min(left, 0.5 if stop is not None else 1.0))
                except StoreTimeout:
                    pass
            else:  # present but not believed: the store cannot wait for a change, so poll
                time.sleep(min(left, poll))


class Follower:
    """:meth:`Records.wait` on one key, asked again and again (a failure watch asks each
    second): on a store that keeps watch streams open (etcd) one stream serves every ask,
    where each ``Store.wait`` would open a stream (a request) of its own."""

    def __init__(self, records: Records, key: str) -> None:
        self.records, self.key = records, key
        self._keys: KeysWatch | None = None
        self._absent = False  # the last ask read no value: the next one waits before it reads

    def wait(self, timeout: float) -> dict[str, Any] | None:
        store = self.records.store
        if not store.lease_liveness:
            return self._wait_plain(timeout)
        if self._keys is None:
            got, revision = store.leased_get([self.key])
            raw = got[0][0]
            self._keys = store.watch_keys([self.key], revision)
            record = self.records.open(self.key, raw)
            if record is not None:
                return record
        if not self._keys.touched(timeout):
            return None
        return self.records.open(self.key, store.try_get(self.key))

    def _wait_plain(self, timeout: float) -> dict[str, Any] | None:
        """On a store without streams (TCPStore, file): one ``wait`` per ask while the key is
        absent, and a read only when it returns. :meth:`Records.wait` reads before and after
        each wait, and an ask that follows an ask reads again: three requests a second per node
        for a key that is almost never written, where one does."""
        store = self.records.store
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            if self._absent:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                try:
                    store.wait([self.key], left)
                except StoreTimeout:
                    return None
            raw = store.try_get(self.key)
            self._absent = raw is None
            record = self.records.open(self.key, raw)
            left = deadline - time.monotonic()
            if record is not None or left <= 0:
                return record
            if raw is not None:  # present but not believed: the store cannot wait for a change
                time.sleep(min(left, 0.25))

    def close(self) -> None:
        """End the stream (after a store error too: the next ask opens a new one)."""
        self._absent = False  # and read first: the key may have been written meanwhile
        keys, self._keys = self._keys, None
        if keys is not None:
            keys.close()

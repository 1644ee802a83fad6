"""The one key-value interface every elastictk layer talks to.

Rendezvous, failure propagation, the restart budget and the timers all need the same few
primitives: a value that appears (``get`` waits for it), an atomic counter (``add``), a
compare-and-set, and blocking waits with deadlines. Keeping them behind one ABC lets a job move
between a single-host file store, torch's c10d ``TCPStore`` and a replicated etcd cluster
without the layers above noticing.

Values are bytes; counters are stored as ASCII decimal, the way torch's stores keep them, so a
counter written by ``add`` reads back as ``b"3"`` from every backend.
"""
from __future__ import annotations

import random
import time
from abc import ABC, abstractmethod
from typing import Callable, Iterable, Protocol, Sequence

DEFAULT_TIMEOUT = 30.0
_BACKOFF_FIRST, _BACKOFF_CAP = 0.001, 0.1  # seconds, after a lost compare-and-set race


class StoreError(RuntimeError):
    """A store operation failed; the message names the store and the key."""


class StoreTimeout(StoreError, TimeoutError):
    """A blocking call ran past its timeout."""


class StoreUnreachable(StoreError, ConnectionError):
    """The store's endpoint cannot be reached (refused, no route, no answer in time)."""


class StoreClosed(StoreError):
    """The store was closed by its owner and can no longer be used."""


class Deadline:
    """A monotonic deadline, so waits survive wall-clock jumps on any host."""

    __slots__ = ("at",)

    def __init__(self, timeout: float | None) -> None:
        self.at = None if timeout is None else time.monotonic() + max(0.0, timeout)

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at


class Backoff:
    """Randomised exponential pauses between the tries of a compare-and-set loop.

    K writers racing on one key without a pause cost about K**2/2 transactions (each round
    of the race has one winner and K-1 losers that retry at once); a full-jitter pause that
    doubles per lost race (up to :data:`_BACKOFF_CAP`) spreads the losers out.
    """

    __slots__ = ("_next", "_sleep", "tries")

    def __init__(self, sleep: Callable[[float], None] = time.sleep) -> None:
        self._next = _BACKOFF_FIRST
        self._sleep = sleep
        self.tries = 0

    def sleep(self, deadline: Deadline | None = None) -> None:
        self.tries += 1
        pause = random.uniform(0.0, self._next)
        left = deadline.remaining() if deadline is not None else None
        self._sleep(pause if left is None else min(pause, left))
        self._next = min(self._next * 2, _BACKOFF_CAP)


class CreatedWatch(Protocol):
    """What :meth:`Store.watch_created` returns (etcd: one open watch stream)."""

    def wait(self, timeout: float) -> bool: ...
    def close(self) -> None: ...


class KeysWatch(Protocol):
    """What :meth:`Store.watch_keys` returns (etcd: one open watch stream per key)."""

    def touched(self, timeout: float = 0.0) -> set[str]: ...
    def close(self) -> None: ...


class Store(ABC):
    """A key-value store with atomic counters, compare-and-set and blocking waits.

    Every blocking call takes ``timeout`` in seconds; ``None`` means the store's
    ``default_timeout``. No call blocks past its timeout.

    A store object is not meant to be shared by threads that block: a thread that waits
    (a watcher, a heartbeat) takes its own connection with :meth:`clone`.
    """

    default_timeout: float = DEFAULT_TIMEOUT

    # -- the primitives each backend provides ---------------------------------------------
    @abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``, replacing what was there."""

    @abstractmethod
    def try_get(self, key: str) -> bytes | None:
        """The value of ``key`` now, or ``None`` when it is absent. Never waits."""

    @abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key`` (absent counts as 0); the new value."""

    @abstractmethod
    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes | None:
        """Atomically set ``key`` to ``desired`` if it currently holds ``expected``.

        ``expected=None`` (or ``b""``) matches an absent key (and, as in torch's stores, an
        empty value). Returns the value the key holds after the call: ``desired`` when the
        swap happened (or the key already held ``desired``), else the current value, or
        ``None`` when the key is absent.
        """

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it existed."""

    @abstractmethod
    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        """Block until every key in ``keys`` exists; :class:`StoreTimeout` past ``timeout``."""

    @abstractmethod
    def keys(self, prefix: str = "") -> list[str]:
        """All keys that start with ``prefix``, in no particular order."""

    @abstractmethod
    def clone(self) -> "Store":
        """A new, independent connection to the same store, for another thread."""

    @abstractmethod
    def close(self) -> None:
        """Release connections (and stop a server this object owns). Idempotent."""

    @abstractmethod
    def describe(self) -> str:
        """Where this store lives, for error messages: ``tcp://host:port``, ``file:///dir``."""

    # -- conveniences built on the primitives ----------------------------------------------
    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting until it exists; :class:`StoreTimeout` past ``timeout``."""
        t = self._timeout(timeout)
        deadline = Deadline(t)
        while True:
            value = self.try_get(key)
            if value is not None:
                return value
            try:
                self.wait([key], deadline.remaining())
            except StoreTimeout:
                raise self._timeout_error([key], t) from None

    def multi_get(self, keys: Iterable[str]) -> list[bytes | None]:
        """``try_get`` for many keys; backends with a batched call override it."""
        return [self.try_get(k) for k in keys]

    def multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        """``set`` for many keys (one writer publishing many records: a round's assignments);
        backends with a batched call override it. Every value is visible when it returns."""
        for key, value in items:
            self.set(key, value)

    # -- optional: arrivals ordered by the store itself, under a lease (etcd) ---------------
    #: Whether the store offers the primitives below. etcd does: there a joiner's arrival is a
    #: key under its own lease, ordered by the revision that created it, so no shared counter
    #: is raced and a dead node's keys vanish with its lease. The other stores join through a
    #: counter and slots (one ``add``, one ``set``), which costs them no more.
    ordered_arrivals: bool = False

    def grant_lease(self, ttl: float) -> int:
        """A lease living ``ttl`` seconds unless renewed (:meth:`keepalive`)."""
        raise self._unsupported("grant_lease")

    def keepalive(self, lease_id: int) -> float:
        """Renew the lease; its TTL."""
        raise self._unsupported("keepalive")

    def revoke(self, lease_id: int) -> bool:
        """End the lease now, deleting its keys; whether it still existed."""
        raise self._unsupported("revoke")

    def arrive(self, key: str, value: bytes, lease: int, *, unless: Sequence[str] = (),
               claim: tuple[str, bytes] | None = None) -> tuple[bool, bool]:
        """In one atomic step: unless a key of ``unless`` exists, create ``key`` (kept while
        ``lease`` lives) and, if ``claim``'s key is absent, create it too (same lease).
        ``(arrived, claimed)``; ``arrived`` is False when an ``unless`` key was there."""
        raise self._unsupported("arrive")

    def claim(self, key: str, value: bytes, lease: int) -> bool:
        """Create ``key`` under ``lease`` unless it exists; whether this call created it."""
        raise self._unsupported("claim")

    def created_since(self, prefix: str, revision: int, limit: int = 0) -> tuple[list[tuple[str, bytes]], int]:
        """Keys under ``prefix`` created after ``revision``, in creation order (names relative
        to ``prefix``, with their values; the first ``limit`` of them when given), and the
        revision to pass next time."""
        raise self._unsupported("created_since")

    def wait_created(self, prefix: str, revision: int, count: int, timeout: float) -> bool:
        """Block until ``count`` keys under ``prefix`` were created after ``revision`` (False
        past ``timeout``)."""
        raise self._unsupported("wait_created")

    def watch_created(self, prefix: str, revision: int) -> "CreatedWatch":
        """A long-lived watch for creations under ``prefix`` after ``revision``: its
        ``wait(timeout)`` says whether one came, without a request per ask."""
        raise self._unsupported("watch_created")

    def count(self, prefix: str) -> int:
        """How many keys live under ``prefix`` (one request; their names are not sent)."""
        raise self._unsupported("count")

    def await_value(self, key: str, timeout: float,
                    stop: Callable[[], bool] | None = None) -> bytes | None:
        """``key``'s value as soon as it exists (one read, then one watch); None past
        ``timeout`` or once ``stop()`` is true (looked at every half second)."""
        raise self._unsupported("await_value")

    # -- optional: liveness by lease (etcd) -------------------------------------------------
    #: Whether a node's liveness is its lease (a key it keeps under it) rather than a counter
    #: it bumps: etcd's keepalive is not a replicated write, a counter bump is.
    lease_liveness: bool = False

    def set_with_lease(self, key: str, value: bytes, lease_id: int) -> None:
        """``set`` whose key is deleted when the lease expires or is revoked."""
        raise self._unsupported("set_with_lease")

    def leased_get(self, keys: Sequence[str]) -> tuple[list[tuple[bytes | None, int]], int]:
        """Each key's ``(value, lease)`` (lease 0: none; ``(None, 0)``: absent) and the revision."""
        raise self._unsupported("leased_get")

    def lease_ttl(self, lease_id: int) -> float:
        """Seconds the lease has left; below 0 when it is gone."""
        raise self._unsupported("lease_ttl")

    def watch_keys(self, keys: Sequence[str], revision: int) -> "KeysWatch":
        """Long-lived watches on ``keys`` from ``revision + 1``; ``touched()`` never blocks."""
        raise self._unsupported("watch_keys")

    def _unsupported(self, what: str) -> StoreError:
        return StoreError(f"{self.describe()} has no {what}(): only a store with ordered_arrivals "
                          "(etcd) offers it")

    def num_keys(self) -> int:
        return len(self.keys(""))

    def _timeout(self, timeout: float | None) -> float:
        return self.default_timeout if timeout is None else timeout

    def _timeout_error(self, keys: Sequence[str], timeout: float) -> StoreTimeout:
        shown = ", ".join(repr(k) for k in list(keys)[:5]) + (" ..." if len(keys) > 5 else "")
        return StoreTimeout(
            f"timed out after {timeout:g}s waiting for key(s) {shown} in {self.describe()}; "
            "check that every participant uses the same store and job id, or raise the timeout"
        )

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

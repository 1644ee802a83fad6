"""A namespaced view of a store, so one server can hold many jobs and rendezvous rounds."""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

from .base import CreatedWatch, KeysWatch, Store


class PrefixStore(Store):
    """Every key is stored as ``prefix + "/" + key`` in the underlying store.

    Closing a view does not close the store under it: the view does not own it. A
    :meth:`clone` is different: its connection under the view is new and nobody else holds
    it, so the clone owns it and closing the clone closes it (else every clone leaks a
    connection: an agent cloned two per round and ran out of descriptors).
    """

    def __init__(self, prefix: str, store: Store, *, owns: bool = False) -> None:
        if not prefix:
            raise ValueError("PrefixStore needs a non-empty prefix")
        self.prefix = prefix.rstrip("/") + "/"
        self.inner = store
        self._owns = owns
        self.default_timeout = store.default_timeout

    def _k(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(self._k(key), value)

    def try_get(self, key: str) -> bytes | None:
        return self.inner.try_get(self._k(key))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self.inner.get(self._k(key), self._timeout(timeout))

    def multi_get(self, keys: Iterable[str]) -> list[bytes | None]:
        return self.inner.multi_get([self._k(k) for k in keys])

    def multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        self.inner.multi_set([(self._k(k), v) for k, v in items])

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(self._k(key), amount)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes | None:
        return self.inner.compare_set(self._k(key), expected, desired)

    def delete(self, key: str) -> bool:
        return self.inner.delete(self._k(key))

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        self.inner.wait([self._k(k) for k in keys], self._timeout(timeout))

    def keys(self, prefix: str = "") -> list[str]:
        n = len(self.prefix)
        return [k[n:] for k in self.inner.keys(self._k(prefix))]

    @property
    def ordered_arrivals(self) -> bool:  # type: ignore[override]
        return self.inner.ordered_arrivals

    def grant_lease(self, ttl: float) -> int:
        return self.inner.grant_lease(ttl)

    def keepalive(self, lease_id: int) -> float:
        return self.inner.keepalive(lease_id)

    def revoke(self, lease_id: int) -> bool:
        return self.inner.revoke(lease_id)

    def arrive(self, key: str, value: bytes, lease: int, *, unless: Sequence[str] = (),
               claim: tuple[str, bytes] | None = None) -> tuple[bool, bool]:
        return self.inner.arrive(self._k(key), value, lease, unless=[self._k(k) for k in unless],
                                 claim=None if claim is None else (self._k(claim[0]), claim[1]))

    def claim(self, key: str, value: bytes, lease: int) -> bool:
        return self.inner.claim(self._k(key), value, lease)

    def created_since(self, prefix: str, revision: int, limit: int = 0) -> tuple[list[tuple[str, bytes]], int]:
        if limit > 0:  # passed on only when asked for: a store of before the limit still serves
            return self.inner.created_since(self._k(prefix), revision, limit)
        return self.inner.created_since(self._k(prefix), revision)

    def wait_created(self, prefix: str, revision: int, count: int, timeout: float) -> bool:
        return self.inner.wait_created(self._k(prefix), revision, count, timeout)

    def watch_created(self, prefix: str, revision: int) -> CreatedWatch:
        return self.inner.watch_created(self._k(prefix), revision)

    def count(self, prefix: str) -> int:
        return self.inner.count(self._k(prefix))

    def await_value(self, key: str, timeout: float,
                    stop: Callable[[], bool] | None = None) -> bytes | None:
        return self.inner.await_value(self._k(key), timeout, stop)

    @property
    def lease_liveness(self) -> bool:  # type: ignore[override]
        return self.inner.lease_liveness

    def set_with_lease(self, key: str, value: bytes, lease_id: int) -> None:
        self.inner.set_with_lease(self._k(key), value, lease_id)

    def leased_get(self, keys: Sequence[str]) -> tuple[list[tuple[bytes | None, int]], int]:
        return self.inner.leased_get([self._k(k) for k in keys])

    def lease_ttl(self, lease_id: int) -> float:
        return self.inner.lease_ttl(lease_id)

    def watch_keys(self, keys: Sequence[str], revision: int) -> KeysWatch:
        return _Unprefixed(self.inner.watch_keys([self._k(k) for k in keys], revision), len(self.prefix))

    def clone(self) -> "PrefixStore":
        return PrefixStore(self.prefix, self.inner.clone(), owns=True)

    def close(self) -> None:
        """A view leaves the store under it open; a clone closes the connection it owns."""
        if self._owns:
            self.inner.close()

    def describe(self) -> str:
        return f"{self.inner.describe()} (prefix {self.prefix!r})"


class _Unprefixed:
    """A :class:`KeysWatch` of the inner store that names keys as the view does."""

    def __init__(self, inner: KeysWatch, n: int) -> None:
        self._inner, self._n = inner, n

    def touched(self, timeout: float = 0.0) -> set[str]:
        return {k[self._n:] for k in self._inner.touched(timeout)}

    def close(self) -> None:
        self._inner.close()

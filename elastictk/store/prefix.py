"""A namespaced view of a store, so one server can hold many jobs and rendezvous rounds."""
from __future__ import annotations

from typing import Iterable, Sequence

from .base import Store


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

    def clone(self) -> "PrefixStore":
        return PrefixStore(self.prefix, self.inner.clone(), owns=True)

    def close(self) -> None:
        """A view leaves the store under it open; a clone closes the connection it owns."""
        if self._owns:
            self.inner.close()

    def describe(self) -> str:
        return f"{self.inner.describe()} (prefix {self.prefix!r})"

"""torch's c10d ``TCPStore`` (libuv server) behind elastictk's :class:`Store` interface.

The server lives inside whichever process constructs it with ``is_server=True`` (in a job,
usually the agent of node 0): fast, but a single point of failure. The etcd backend is the
choice for jobs that must survive the loss of that host.
"""
from __future__ import annotations

import datetime
import os
import time
from contextlib import contextmanager
from typing import Iterable, Iterator, Sequence

from .base import (
    DEFAULT_TIMEOUT, Deadline, Store, StoreClosed, StoreError, StoreTimeout, StoreUnreachable,
)
from .endpoint import Endpoint, parse_endpoint
from .listen import is_unspecified, listen_socket, ping_store

# c10d logs every client timeout at warning level from C++; elastictk reports them itself, so
# torch is loaded quietly here, the workers' environment untouched (see .cpplog).
from .cpplog import import_torch_quietly

import_torch_quietly()
import torch.distributed as dist  # noqa: E402  (after the log level is set)

# A value no one stores: ``compare_set(key, _ABSENT, _ABSENT)`` reads a key in one atomic round
# trip without creating it (c10d returns ``expected`` for an absent key and never writes it, but
# wakes the key's waiters: ``try_get`` checks first).
_ABSENT = b"\x00elastictk-absent\x00" + os.urandom(16)
_MULTI_SET_BATCH = 256  # keys per MULTI_SET request: one closer publishing a round's assignments


def unreachable(endpoint: Endpoint, reason: str) -> StoreUnreachable:
    """The one line for a TCPStore that did not answer at ``endpoint``."""
    return StoreUnreachable(f"cannot reach the TCPStore at {endpoint}: {reason}; check --rdzv-endpoint "
                            "and that the node hosting the store is up")


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


class TCPStore(Store):
    """A client of (or the server plus a client of) a c10d TCPStore.

    ``TCPStore.serve(host, port)`` starts a server in this process; port 0 picks a free port,
    reported by :attr:`port`. ``TCPStore.connect("host:port")`` joins an existing one, failing
    within ``timeout`` with one line naming the endpoint when nothing answers there.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        is_server: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        listen: str | None = None,
        _raw: "dist.TCPStore | None" = None,
    ) -> None:
        self.default_timeout = timeout
        self.is_server = is_server
        self.host = host
        if _raw is not None:
            self._raw: dist.TCPStore | None = _raw
        elif is_server:
            self._raw = _serve(host, port, host if listen is None else listen, timeout)
        else:
            deadline = Deadline(timeout)
            endpoint = Endpoint(host, port)
            reason = ping_store(endpoint, timeout)  # a deadline of ours, before torch's client
            if reason is not None:
                raise unreachable(endpoint, reason)
            try:
                self._raw = dist.TCPStore(
                    host, port, is_master=False, timeout=_td(deadline.remaining() or 0.001),
                    use_libuv=True,
                )
            except (RuntimeError, OSError) as e:
                raise StoreUnreachable(
                    f"cannot connect to the TCPStore at {endpoint}: {_first_line(e)}"
                ) from None
        self.port = int(self._raw.port)

    @classmethod
    def serve(cls, host: str = "127.0.0.1", port: int = 0, timeout: float = DEFAULT_TIMEOUT, *,
              listen: str | None = None) -> "TCPStore":
        """A server listening on ``listen`` (default: ``host``, resolved), ``port``; an
        unspecified address (``0.0.0.0``, ``::``) listens on every interface."""
        return cls(host, port, is_server=True, timeout=timeout, listen=listen)

    @classmethod
    def connect(cls, endpoint: str | Endpoint, timeout: float = DEFAULT_TIMEOUT) -> "TCPStore":
        ep = endpoint if isinstance(endpoint, Endpoint) else parse_endpoint(endpoint)
        return cls(ep.host, ep.port, timeout=timeout)

    @property
    def raw(self) -> "dist.TCPStore":
        """The torch store itself, e.g. to hand to ``init_process_group(store=...)``."""
        if self._raw is None:
            raise StoreClosed(f"{self.describe()} is closed")
        return self._raw

    @contextmanager
    def _op(self, what: str, keys: Sequence[str] = ()) -> Iterator["dist.TCPStore"]:
        raw = self.raw
        try:
            yield raw
        except dist.DistNetworkError as e:
            raise self._lost(what, e) from None
        except dist.DistStoreError as e:
            if "timeout" in str(e).lower():
                raise self._timeout_error(keys, self.default_timeout) from None
            raise StoreError(f"{what} on {self.describe()} failed: {_first_line(e)}") from None

    def _lost(self, what: str, e: BaseException) -> StoreUnreachable:
        return StoreUnreachable(
            f"lost the TCPStore at {self.describe()} during {what} ({_first_line(e)}): the process "
            "hosting it (for c10d, the agent on the endpoint's host) has died; a job that must "
            "survive that uses --rdzv-backend etcd"
        )

    def set(self, key: str, value: bytes) -> None:
        with self._op("set", [key]) as s:
            s.set(key, value)  # type: ignore[arg-type]  # torch's stub says str; bytes are kept as is
            # torch's SET is sent without waiting for a reply, so another client's read right
            # after could still see the old value. A round trip on the same connection (the
            # server serves one connection in order) makes the write visible before we return,
            # as it is with the file and etcd stores.
            s.check([key])

    def try_get(self, key: str) -> bytes | None:
        # Checked first: c10d's server wakes every client waiting on a key when anyone
        # compare-and-sets it while it is absent (its blocked ``get`` then returns b""), so a
        # read of an absent key must not be a compare-and-set. Present: one atomic read.
        with self._op("get", [key]) as s:
            if not s.check([key]):
                return None
            value = s.compare_set(key, _ABSENT, _ABSENT)  # type: ignore[arg-type]  # bytes, as set
        return None if value == _ABSENT else bytes(value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
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
            if deadline.expired():  # the key appeared and vanished again at the last moment
                raise self._timeout_error([key], t)

    def multi_get(self, keys: Iterable[str]) -> list[bytes | None]:
        """Two round trips when every key exists (the common case: slots, heartbeats)."""
        keys = list(keys)
        if not keys:
            return []
        with self._op("multi_get", keys) as s:
            if s.check(keys):
                try:
                    return [bytes(v) for v in s.multi_get(keys)]
                except dist.DistStoreError:
                    pass  # a key vanished between the two calls: read them one by one
        return [self.try_get(k) for k in keys]

    def multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Batches of c10d's MULTI_SET (one request each), then one check on the same
        connection, which makes every write visible before this returns (as ``set``)."""
        items = list(items)
        if not items:
            return
        with self._op("multi_set", [k for k, _ in items[:5]]) as s:
            for i in range(0, len(items), _MULTI_SET_BATCH):
                batch = items[i:i + _MULTI_SET_BATCH]
                s.multi_set([k for k, _ in batch], [v for _, v in batch])  # type: ignore[attr-defined]  # in torch, not its stub
            s.check([items[-1][0]])

    def add(self, key: str, amount: int) -> int:
        with self._op("add", [key]) as s:
            return int(s.add(key, amount))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes | None:
        exp = expected or b""
        if exp and exp == desired:
            # A no-op swap; c10d would echo ``expected`` for an absent key too, so ask directly.
            return self.try_get(key)
        with self._op("compare_set", [key]) as s:
            value = bytes(s.compare_set(key, exp, desired))  # type: ignore[arg-type]  # bytes, as set
        if exp and value == exp and exp != desired:
            return None  # c10d echoes ``expected`` back for an absent key
        return value

    def delete(self, key: str) -> bool:
        with self._op("delete", [key]) as s:
            return bool(s.delete_key(key))

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        t = self._timeout(timeout)
        if not keys:
            return
        raw = self.raw
        start = time.monotonic()
        try:
            raw.wait(list(keys), _td(t))
        except dist.DistNetworkError as e:
            raise self._lost("wait", e) from None
        except dist.DistStoreError as e:
            if "timeout" in str(e).lower() or time.monotonic() - start >= t:
                raise self._timeout_error(keys, t) from None
            raise StoreError(f"wait on {self.describe()} failed: {_first_line(e)}") from None

    def keys(self, prefix: str = "") -> list[str]:
        with self._op("list_keys") as s:
            return [k for k in s.list_keys() if k.startswith(prefix)]

    def num_keys(self) -> int:
        with self._op("num_keys") as s:
            return int(s.num_keys())

    def clone(self) -> "TCPStore":
        with self._op("clone") as s:
            raw = s.clone()  # type: ignore[attr-defined]  # torch >= 2.4 has it; the stub lags
        return TCPStore(self.host, self.port, timeout=self.default_timeout, _raw=raw)

    def close(self) -> None:
        self._raw = None

    def describe(self) -> str:
        return f"tcp://{Endpoint(self.host, getattr(self, 'port', 0))}"


def _serve(host: str, port: int, listen: str, timeout: float) -> "dist.TCPStore":
    """torch's server on a socket bound to ``listen`` (torch itself would bind ``::``), or on
    every interface when ``listen`` is unspecified."""
    where = Endpoint(listen if listen and not is_unspecified(listen) else host, port)
    fd: int | None = None
    try:
        if listen and not is_unspecified(listen):
            fd = listen_socket(listen, port).detach()  # the store owns it from here
        raw = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                            timeout=_td(timeout), use_libuv=True, master_listen_fd=fd)
    except (RuntimeError, OSError) as e:
        if fd is not None and isinstance(e, RuntimeError):
            try:
                os.close(fd)
            except OSError:
                pass
        raise StoreUnreachable(
            f"cannot start a TCPStore server on {where}: {_first_line(e)}; "
            "pick another port or use port 0 for a free one"
        ) from None
    return raw


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__

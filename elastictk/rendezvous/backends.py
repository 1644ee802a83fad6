"""From ``--rdzv-backend``/``--rdzv-endpoint`` to a store, deciding who hosts a c10d server.

``c10d``: the node whose address matches the endpoint hosts the TCPStore (inside its agent: fast,
but the job dies with that host); ``etcd``: a replicated etcd cluster, which survives any one
host; ``file``: a directory on local disk or NFS; ``static``: a TCPStore at the master address,
hosted by node rank 0, for fixed-size jobs.
"""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Callable, Mapping

import psutil

from ..store import Endpoint, Store, StoreError, StoreUnreachable, parse_endpoint

DEFAULT_PORTS = {"c10d": 29400, "etcd": 2379, "static": 29500}
BACKENDS = ("c10d", "etcd", "file", "static")


@dataclass
class StoreHandle:
    """The job's store and whether this process hosts its server (and so must outlive peers)."""

    store: Store
    is_host: bool
    endpoint: str

    def close(self) -> None:
        self.store.close()


def local_addresses() -> set[str]:
    """Every name and address this machine answers to."""
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                names.add(a.address.split("%")[0])
    return names


def is_local(host: str) -> bool:
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    return host in local_addresses()


def _tcp(ep: Endpoint, host_it: bool | None, timeout: float) -> StoreHandle:
    from ..store.tcp import TCPStore

    if host_it or (host_it is None and is_local(ep.host)):
        try:
            return StoreHandle(TCPStore.serve(ep.host, ep.port, timeout), True, str(ep))
        except StoreUnreachable:
            if host_it:
                raise
            # Another agent on this machine hosts it already (several agents per host): join it.
    return StoreHandle(TCPStore.connect(ep, timeout), False, str(ep))


def open_store(
    backend: str,
    endpoint: str,
    *,
    is_host: bool | None = None,
    timeout: float = 30.0,
    node_rank: int | None = None,
    conf: Mapping[str, object] | None = None,
) -> StoreHandle:
    """Open (or host) the job's store; errors are one line naming the endpoint and the fix.

    ``conf``: the ``--rdzv-conf`` values; etcd takes ``protocol``/``cacert``/``cert``/``key``.
    """
    opener: dict[str, Callable[[], StoreHandle]] = {
        "c10d": lambda: _tcp(parse_endpoint(endpoint, DEFAULT_PORTS["c10d"]), is_host, timeout),
        "static": lambda: _tcp(parse_endpoint(endpoint, DEFAULT_PORTS["static"]),
                               node_rank == 0 if is_host is None else is_host, timeout),
        "etcd": lambda: _etcd(endpoint, timeout, conf or {}),
        "file": lambda: _file(endpoint, timeout),
    }
    if backend not in opener:
        raise StoreError(f"unknown rendezvous backend {backend!r}; use one of {', '.join(BACKENDS)}")
    return opener[backend]()


def _etcd(endpoint: str, timeout: float, conf: Mapping[str, object]) -> StoreHandle:
    from ..store.etcd import EtcdStore, tls_context

    tls = None
    if conf.get("protocol") == "https":  # over TLS, with the CA and client certificate given
        cacert, cert, key = (None if conf.get(k) is None else str(conf[k])
                             for k in ("cacert", "cert", "key"))
        tls = tls_context(cacert, cert, key)
    return StoreHandle(EtcdStore(endpoint.split(","), timeout=timeout, tls=tls), False, endpoint)


def _file(path: str, timeout: float) -> StoreHandle:
    from ..store.file import FileStore

    if not path:
        raise StoreError("the file backend needs a directory: --rdzv-endpoint /shared/dir")
    return StoreHandle(FileStore(path, timeout=timeout), False, path)

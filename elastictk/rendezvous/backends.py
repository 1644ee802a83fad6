"""From ``--rdzv-backend``/``--rdzv-endpoint`` to a store, deciding who hosts a c10d server.

``c10d``: the node whose address matches the endpoint hosts the TCPStore (inside its agent: fast,
but the job dies with that host); ``etcd``: a replicated etcd cluster, which survives any one
host; ``file``: a directory on local disk or NFS; ``static``: a TCPStore at the master address,
hosted by node rank 0, for fixed-size jobs.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

import psutil

from ..store import Endpoint, Store, StoreError, StoreUnreachable, parse_endpoint
from ..store.wait import wait_for_store

log = logging.getLogger("elastictk.rendezvous")

class Closeable(Protocol):
    def close(self) -> None: ...


DEFAULT_PORTS = {"c10d": 29400, "etcd": 2379, "static": 29500}
BACKENDS = ("c10d", "etcd", "file", "static")


@dataclass
class StoreHandle:
    """The job's store and whether this process hosts its server (and so must outlive peers)."""

    store: Store
    is_host: bool
    endpoint: str
    # What else the agent built on this store and owns until the job ends (the workers' store).
    owned: list[Closeable] = field(default_factory=list)

    def close(self) -> None:
        for thing in reversed(self.owned):
            thing.close()
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


def listen_address(host: str, *, single_node: bool, local_addr: str | None = None) -> str:
    """Where a store hosted for endpoint ``host`` listens: the address peers dial it by.

    An address of this machine is used as it is (loopback too: peers dial that very address);
    ``0.0.0.0``/``::`` mean every interface. A name is resolved: to an address of this machine,
    that one; to loopback only (``localhost``; Debian maps the host's own name to 127.0.1.1),
    loopback for a one-node job, else ``--local-addr`` if given, else every interface (peers
    reach this host by another address). An address that is not this machine's (a NAT or a
    virtual IP in front of it) is served on every interface, as torch's store does.
    """
    try:
        candidates = [str(ipaddress.ip_address(host.strip("[]")))]
        literal = True
    except ValueError:
        literal = False
        try:
            candidates = [str(i[4][0]) for i in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]
        except OSError:
            candidates = []
        candidates.sort(key=lambda a: ":" in a)  # IPv4 first, as clients try it first
    mine = local_addresses()
    for a in candidates:
        ip = ipaddress.ip_address(a.split("%")[0])
        if ip.is_unspecified or (a in mine and not ip.is_loopback):
            return a
    loopback = [a for a in candidates if ipaddress.ip_address(a.split("%")[0]).is_loopback]
    if loopback and (literal or single_node):
        return loopback[0]
    return local_addr or "::"


def _tcp(ep: Endpoint, host_it: bool | None, timeout: float, listen: str) -> StoreHandle:
    """Host the store or join it; a node that joins waits up to ``timeout`` (``read_timeout``)
    for the host to listen, as torch's client does: nodes start in any order."""
    from ..store.tcp import TCPStore, unreachable

    if host_it or (host_it is None and is_local(ep.host)):
        try:
            return StoreHandle(TCPStore.serve(ep.host, ep.port, timeout, listen=listen), True,
                               str(ep))
        except StoreUnreachable:
            if host_it:
                raise
            # Another agent on this machine hosts it already (several agents per host): join it.
    reason = wait_for_store(ep, timeout, lambda line: log.info("%s", line))
    if reason is not None:
        raise unreachable(ep, reason)
    return StoreHandle(TCPStore.connect(ep, timeout), False, str(ep))


def open_store(
    backend: str,
    endpoint: str,
    *,
    is_host: bool | None = None,
    timeout: float = 30.0,
    node_rank: int | None = None,
    conf: Mapping[str, object] | None = None,
    single_node: bool = False,
    local_addr: str | None = None,
) -> StoreHandle:
    """Open (or host) the job's store; errors are one line naming the endpoint and the fix.

    ``conf``: the ``--rdzv-conf`` values; etcd takes ``protocol``/``cacert``/``cert``/``key``.
    A hosted c10d/static store listens where :func:`listen_address` says (``single_node``: the
    job has one node; ``local_addr``: ``--local-addr``).
    """
    def tcp(default_port: int, host_it: bool | None) -> StoreHandle:
        ep = parse_endpoint(endpoint, default_port)
        listen = listen_address(ep.host, single_node=single_node, local_addr=local_addr)
        return _tcp(ep, host_it, timeout, listen)

    opener: dict[str, Callable[[], StoreHandle]] = {
        "c10d": lambda: tcp(DEFAULT_PORTS["c10d"], is_host),
        "static": lambda: tcp(DEFAULT_PORTS["static"], node_rank == 0 if is_host is None else is_host),
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

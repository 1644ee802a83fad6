"""``EtcdCluster``: several local etcd members that form one cluster, for failover tests.

Apart from ``etcd.py`` (one member) because a cluster is its own setup: ports picked for every
member before any starts, one ``--initial-cluster`` for all, every member launched before any
is waited for (a member is healthy only once a quorum is up).
"""
from __future__ import annotations

import os
import uuid

from ..store.endpoint import Endpoint, quiet_port
from .etcd import EtcdServer
from .testcerts import TestCerts


class EtcdCluster:
    """``size`` members on loopback forming one etcd cluster; ``endpoints`` lists their clients.

    ``tls``: every member's client port over HTTPS, as for :class:`EtcdServer`."""

    def __init__(self, size: int = 3, *, host: str = "127.0.0.1",
                 base_dir: str | os.PathLike[str] | None = None,
                 binary: str | os.PathLike[str] | None = None,
                 start_timeout: float = 60.0, tls: TestCerts | None = None) -> None:
        if size < 1:
            raise ValueError(f"an etcd cluster needs at least 1 member, not {size}")
        ports: list[int] = []
        while len(ports) < 2 * size:  # quiet_port may hand out the same port twice
            p = quiet_port(host)
            if p not in ports:
                ports.append(p)
        names = [f"etcd{i}" for i in range(size)]
        initial = ",".join(
            f"{n}=http://{Endpoint(host, ports[2 * i + 1])}" for i, n in enumerate(names)
        )
        token = f"elastictk-{uuid.uuid4().hex[:12]}"
        self.members: list[EtcdServer] = []
        try:
            for i, n in enumerate(names):
                self.members.append(EtcdServer(
                    name=n, host=host, client_port=ports[2 * i], peer_port=ports[2 * i + 1],
                    initial_cluster=initial, cluster_token=token, base_dir=base_dir,
                    binary=binary, start_timeout=start_timeout, tls=tls,
                ))
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self) -> "EtcdCluster":
        """Launch every member, then wait for each (a member is healthy once a quorum is up)."""
        try:
            for m in self.members:
                m.launch()
            for m in self.members:
                m.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for m in self.members:
            m.close()

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

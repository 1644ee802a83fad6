"""The workers' ``MASTER_ADDR``/``MASTER_PORT`` and ``TORCHELASTIC_USE_AGENT_STORE``, per backend, as
torchrun decides them.

A script's ``init_process_group`` (``env://``, or ``tcp://MASTER_ADDR:MASTER_PORT``) opens a
TCPStore there. With ``TORCHELASTIC_USE_AGENT_STORE=True`` every rank connects as a client to a
store the agent hosts; with ``False`` rank 0 starts one itself on that port. torchrun:

- ``static``: the agent's store *is* the rendezvous store, hosted by node rank 0 on
  ``--master-addr:--master-port`` (or ``--rdzv-endpoint``); workers get that address and port
  and ``True``. A script that opens ``tcp://localhost:P`` with ``--master-port P`` works.
- ``c10d``: the agent of group rank 0 hosts a store of its own on a free port at its address,
  kept while the agent lives; workers get ``True`` (``False`` and a free port for rank 0's
  worker to bind when ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).
- ``etcd``/``file``: a free port of group rank 0 and ``False``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

from .address import is_ip
from .coordination import agree_master

if TYPE_CHECKING:  # pragma: no cover
    from ..rendezvous import RoundInfo
    from ..rendezvous.sealed import Records
    from ..store import Store
    from ..store.tcp import TCPStore

#: torch's opt-out of the c10d backend's shared store (dynamic_rendezvous.py).
NO_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
#: Where ``init_process_group`` keeps its keys in the store it is given (every process group's,
#: gloo's and NCCL's: ``default_pg/<group>//<device>//...``).
WORKER_PREFIX = "default_pg/"


def forget_workers(store: "Store") -> int:
    """Delete the keys a previous attempt's process groups left in ``store``; how many."""
    stale = store.keys(WORKER_PREFIX)
    for key in stale:
        store.delete(key)
    return len(stale)


@dataclass
class WorkersStore:
    """Where this node's workers find their store; hosts it when torchrun's agent would.

    ``fixed``: static's ``(addr, port)`` of the agent's store. ``shared``: c10d's store hosted
    by the agent of group rank 0 (:meth:`close` stops it). Neither: torch's free port.
    """

    fixed: tuple[str, int] | None = None
    shared: bool = False
    root: "Store | None" = field(default=None, repr=False)  # static: the rendezvous store itself
    _server: "TCPStore | None" = field(default=None, repr=False)

    @classmethod
    def for_backend(cls, backend: str, endpoint: tuple[str, int] | None, root: "Store | None" = None,
                    environ: Mapping[str, str] | None = None) -> "WorkersStore":
        env = os.environ if environ is None else environ
        if backend == "static" and endpoint is not None:
            return cls(fixed=endpoint, root=root)
        return cls(shared=backend == "c10d" and env.get(NO_SHARED_STORE_ENV, "0") != "1")

    @property
    def use_agent_store(self) -> bool:
        return self.fixed is not None or self.shared

    def master(self, info: "RoundInfo", addr: str, timeout: float, records: "Records",
               stop: Callable[[], bool]) -> tuple[str, int]:
        """This round's ``MASTER_ADDR``/``MASTER_PORT`` (group rank 0 tells the others).

        Group rank 0 first forgets what the previous attempt's workers left in the store
        (:data:`WORKER_PREFIX`), then publishes; the others wait for that record, so no
        worker of this attempt starts before it. torch leaves those keys: a restarted gloo
        rank 0 may then read its peer's dead address and fail to connect.
        """
        port = None
        if info.rank == 0:
            store = self.root if self.fixed is not None else self._host(addr) if self.shared else None
            if store is not None:
                forget_workers(store)
                port = self.fixed[1] if self.fixed is not None else getattr(store, "port", None)
        published = agree_master(info, addr, timeout, records, stop=stop, port=port)
        return self.fixed if self.fixed is not None else published

    def _host(self, addr: str) -> "TCPStore":
        """The shared store, started on first use at ``addr`` (every interface when ``addr``
        is a name rather than an address) and kept across rounds, as torch's agent keeps it."""
        if self._server is None:
            from ..store.tcp import TCPStore

            self._server = TCPStore.serve(addr, 0, listen=addr if is_ip(addr) else "::")
        return self._server

    def close(self) -> None:
        """Stop the shared store this agent hosts, if it hosts one."""
        self._server, server = None, self._server
        if server is not None:
            server.close()

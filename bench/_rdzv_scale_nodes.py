"""Simulated nodes for the rendezvous scale benchmark: threads running elastictk's real parts.

A simulated node is what an elastic agent runs against the store, without workers:

- its own store client (``TCPStore.connect`` / ``EtcdStore``) and a
  :class:`~elastictk.rendezvous.RendezvousHandler` on it, whose heartbeat thread has a
  connection of its own (started during setup, as an agent can while it prepares its workers);
- once in a round, what ``ElasticAgent._run_round`` starts for it: the
  :class:`~elastictk.rendezvous.watch.MembershipWatch` (the next round's arrivals and two ring
  successors' heartbeats; plus its fence thread, which makes no store call), the
  :class:`~elastictk.agent.coordination.RoundCoordinator` (its failure watch on the round's
  ``failed`` key) and the :class:`~elastictk.agent.stragglers.StragglerWatch` of
  ``--straggler-action report`` (one sealed record per node per window; the round's leader
  reads every member's), with an empty steps block: the record a node without steps writes.

What the simulated nodes share, and why the server sees the same traffic: they share one
Python process (its GIL and this machine's cores), so their own CPU work (JSON, HMACs) is
serialized where real nodes have a host each; the benchmark reports this process's CPU beside
the server's so a curve bent by the clients shows as such. They share nothing on the wire:
every node opens the same connections a real agent opens, each a socket of its own to the
server, and sends the same requests in the same order from the same code.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from elastictk.agent.coordination import Budget, RoundCoordinator
from elastictk.agent.stragglers import StragglerWatch
from elastictk.rendezvous import RendezvousConfig, RendezvousHandler, RoundInfo
from elastictk.rendezvous.watch import MembershipWatch

from ._rdzv_scale_store import Meter, Server, Tally

#: ``--straggler-interval``'s default.
STRAGGLER_INTERVAL = 5.0


class _NoSteps:
    """A steps block with no worker slots: the straggler record of a node without steps."""

    n_workers = 0

    def snapshot(self) -> list[Any]:
        return []


def _quiet(*_a: Any, **_k: Any) -> None:
    """Events and wake-ups go nowhere: there is no agent loop to wake."""


class SimNode:
    """One simulated node (see the module docstring)."""

    def __init__(self, server: Server, tally: Tally, cfg: RendezvousConfig, index: int) -> None:
        self.index = index
        self.meter = Meter()  # this node's own connection: what its joins cost
        self.store = server.connect(tally, self.meter)
        self.handler = RendezvousHandler(self.store, cfg, node_id=f"sim{index:04d}",
                                         meta={"addr": "127.0.0.1", "index": index})
        self.handler.start_heartbeat()
        self.info: RoundInfo | None = None
        self.joined_at: float | None = None
        self.noticed_at: float | None = None
        self.error: BaseException | None = None
        self.cost: dict[str, int] | None = None  # of the last join: calls, bytes, waits, wake-ups
        self._parts: list[Any] = []
        self.watch: MembershipWatch | None = None

    @property
    def node_id(self) -> str:
        return self.handler.node_id

    def join(self) -> None:
        """Join the next round; the time it got its rank (or the error) and what the join cost
        on this node's own connection (calls, bytes, waits, wake-ups, etcd requests) are kept."""
        before, req0 = self.meter.snapshot(), self.store.requests
        try:
            self.info = self.handler.next_round()
            self.joined_at = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - reported by the benchmark, never swallowed
            self.error = e
        after, req1 = self.meter.snapshot(), self.store.requests
        self.cost = {k: after[k] - before[k] for k in after}
        if req0 is not None and req1 is not None:
            self.cost["etcd_requests"] = req1 - req0

    def run_round(self) -> None:
        """Start what the agent runs while its workers train in the round."""
        info = self.info
        assert info is not None
        h = self.handler
        self.watch = MembershipWatch(h, info, on_change=_quiet)
        coord = RoundCoordinator(h.store, info.store, h.node_id, on_failure=_quiet, signer=h.signer,
                                 where=(h.prefix, info.store_prefix), budget=Budget(h.records))
        stragglers = StragglerWatch(_NoSteps(), {}, coord.records,  # type: ignore[arg-type]
                                    node_id=h.node_id, members=[m.node_id for m in info.members] if info.rank == 0 else (),
                                    leader=info.rank == 0, interval=STRAGGLER_INTERVAL, threshold=1.5,
                                    windows=3, emit=_quiet)
        self._parts = [self.watch, coord, stragglers]

    def stop_round(self) -> None:
        for part in self._parts:
            part.stop()
        self._parts = []

    def reform(self, deadline: float, min_nodes: int) -> None:
        """What an agent does when its watch fires: stop the round, join the next one (which
        closes as soon as every live member of the last one is back: ``min_nodes`` and no
        ``last_call``, so the time is the protocol's, not a wait for a replacement)."""
        assert self.watch is not None
        if not self.watch.changed.wait(max(0.0, deadline - time.monotonic())):
            self.error = TimeoutError(f"{self.node_id}: the membership watch never fired")
            return
        self.noticed_at = time.monotonic()
        self.stop_round()
        h = self.handler
        h.config = dataclasses.replace(h.config, min_nodes=min_nodes, last_call=0.0)
        self.join()

    def die(self) -> None:
        """Stop heartbeating without a goodbye, as a host that lost power (its peers must
        notice by the heartbeat timeout)."""
        self.stop_round()
        self.handler.close(leaving=False)

    def close(self) -> None:
        self.handler.interrupt()  # a join still in progress ends within half a second
        self.stop_round()
        self.handler.close(leaving=False)
        self.store.close()


def in_threads(nodes: list[SimNode], method: str, *args: Any, go: threading.Event | None = None) -> list[threading.Thread]:
    """Call ``method`` of every node on a thread of its own (after ``go`` is set, if given)."""
    def body(node: SimNode) -> None:
        if go is not None:
            go.wait()
        getattr(node, method)(*args)

    threads = [threading.Thread(target=body, args=(n,), name=f"sim-{method}-{n.index}", daemon=True)
               for n in nodes]
    for t in threads:
        t.start()
    return threads

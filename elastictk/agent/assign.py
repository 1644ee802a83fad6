"""The workers' assignment for one round: this node's ranks and where rank 0's store listens.

Apart from the loop (``elastic.py``) because it is the one place that turns a closed round
into torchrun's worker environment: this node's global ranks (``node_ranges``), the restart
count, and ``MASTER_ADDR``/``MASTER_PORT`` agreed with group rank 0 (``agree_master``), or, for
a backend where torchrun hosts the workers' store in the agent, the agent store's address
(``WorkersStore``, ``master.py``). Group rank 0 publishes the address as soon as the round
closes, so the others wait a heartbeat timeout for it, not the join timeout: longer means it
is gone, and waiting longer would stall every other node.
"""
from __future__ import annotations

from typing import Callable

from ..rendezvous import RendezvousHandler, RoundInfo
from ..supervisor.env import Assignment
from .config import AgentConfig
from .coordination import agree_master, node_ranges


def round_assignment(cfg: AgentConfig, handler: RendezvousHandler, info: RoundInfo, restarts: int, addr: str,
                     stop: Callable[[], bool]) -> Assignment:
    """This node's :class:`Assignment` in round ``info`` at restart count ``restarts``;
    ``addr`` is the address this agent gives its peers, ``stop`` ends the wait for rank 0."""
    ranks = node_ranges(info, cfg.spec.role, cfg.spec.local_world_size)
    records = handler.records.view(info.store, info.store_prefix)
    ws = cfg.workers_store  # torchrun's agent store per backend (agent/master.py)
    if ws is not None:
        master_addr, master_port = ws.master(info, addr, cfg.rdzv.heartbeat_timeout + 5, records, stop)
    else:
        master_addr, master_port = agree_master(info, addr, cfg.rdzv.heartbeat_timeout + 5, records, stop=stop)
    return Assignment.from_node_ranks(
        info.rank, info.world_size, ranks[info.rank], master_addr=master_addr,
        master_port=master_port, run_id=cfg.rdzv.job_id, restart_count=restarts,
        max_restarts=cfg.max_restarts, use_agent_store=ws is not None and ws.use_agent_store,
    )

"""What this agent says of itself: its join record's meta, and the workers' spec and environment.

Apart from the loop (``elastic.py``) because it is where a reader looks for "why does a worker
(or a peer) see this": the meta every other node reads when a round closes (the address, the
host, the local world, the role, the peer snapshot tier's port, the flags every node must
share), and the workers' environment: the caller's spec, plus what each of the agent's parts
needs in a worker (the steps block and its hooks, the collective timing for the straggler
watch, the timer regions, the snapshot tiers).
"""
from __future__ import annotations

import logging
import socket
from dataclasses import replace
from typing import Any

from ..metrics.steps import WorkerStepsBlock
from ..metrics.worker import ENV_COLLECTIVES, ENV_PATH
from ..snapshot.local import Holder
from ..snapshot.peertier import PeerTier
from ..supervisor.spec import WorkerSpec
from .config import AgentConfig
from .shared_flags import shared_flags
from .stepcount import steps_env
from .watchdog import Watchdog

log = logging.getLogger("elastictk.agent")


def join_meta(cfg: AgentConfig, addr: str, peer: PeerTier | None) -> dict[str, Any]:
    """This node's meta in its join record, read by the round's closer and by rank 0's peers."""
    return {"addr": addr, "host": socket.gethostname(), "nproc": cfg.spec.local_world_size, "role": cfg.spec.role,
            **(peer.meta() if peer is not None else {}),
            **shared_flags(cfg.rdzv.min_nodes, cfg.rdzv.max_nodes, cfg.max_restarts)}


def workers_spec(cfg: AgentConfig, watchdog: Watchdog, steps: WorkerStepsBlock | None,
                 own_steps: WorkerStepsBlock | None, snapshots: Holder | None, peer: PeerTier | None) -> WorkerSpec:
    """The caller's spec with the environment the agent's parts need in every worker; a
    warning when the caller's environment names a steps block this agent was not given."""
    block = steps or watchdog.steps_block()
    if block is not None and cfg.spec.env.get(ENV_PATH, block.path) != block.path:
        log.warning("the workers' environment names a steps block (%s=%s) this agent was not "
                    "given: they count into the agent's own instead; pass the block as "
                    "AgentConfig.steps (build_agent(config, telemetry) does)", ENV_PATH,
                    cfg.spec.env[ENV_PATH])
    base_env = {**cfg.spec.env, **steps_env(own_steps, cfg.spec.env),
                **({ENV_COLLECTIVES: "1"} if cfg.stragglers is not None and cfg.stragglers.on else {})}
    return replace(cfg.spec, env={**watchdog.worker_env(base_env),
                                  **(snapshots.env() if snapshots is not None else {}),
                                  **(peer.env() if peer is not None else {})})

"""The environment a worker sees, exactly as torchrun sets it, computed by pure functions.

Training scripts read ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ... and nothing else about the
launcher, so these names and meanings are the compatibility contract with torchrun. They are
computed here from plain data (an ``Assignment`` from rendezvous) with no process state, so the
invariants (ranks unique and contiguous across nodes, role ranks likewise) are property-tested.

Meanings follow ``torch.distributed.elastic.agent.server`` (``api.py``'s rank assignment and
``local_elastic_agent.py``'s ``_start_workers``):

- ``RANK``: global rank = base global rank of this node + local rank; ``WORLD_SIZE``: all workers.
- ``GROUP_RANK``/``GROUP_WORLD_SIZE``: this agent's rank among agents, and the number of agents.
- ``ROLE_RANK``/``ROLE_WORLD_SIZE``: the same, counting only workers of this role.
- ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``: position among, and number of, workers on this node.
- ``TORCHELASTIC_RESTART_COUNT``: restarts consumed so far; ``..._MAX_RESTARTS``: the budget.
- ``TORCHELASTIC_ERROR_FILE``: where ``@record`` writes the worker's exception ("" if none).
- ``OMP_NUM_THREADS=1`` when several workers share a node, unless the user set it (torchrun).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence


class AssignmentError(ValueError):
    """Ranks that cannot describe a real job; the message names the field."""


@dataclass(frozen=True)
class NodeRanks:
    """Where one node's workers sit in the global and the role rank spaces."""

    base_global_rank: int
    global_world_size: int
    base_role_rank: int
    role_world_size: int


def assign_ranks(nodes: Sequence[tuple[str, int]]) -> list[NodeRanks]:
    """Rank ranges for every node, given each node's ``(role, local_world_size)`` by group rank.

    torch's slow path (``_assign_worker_ranks``): global ranks are the cumulative sum of
    local world sizes in group-rank order; role ranks the same counting only that role.
    """
    for i, (role, size) in enumerate(nodes):
        if size < 1:
            raise AssignmentError(f"node {i} ({role}) has local_world_size {size}; it must be >= 1")
    global_size = sum(size for _, size in nodes)
    role_sizes: dict[str, int] = {}
    for role, size in nodes:
        role_sizes[role] = role_sizes.get(role, 0) + size
    out: list[NodeRanks] = []
    base = 0
    role_base: dict[str, int] = {}
    for role, size in nodes:
        out.append(NodeRanks(base, global_size, role_base.get(role, 0), role_sizes[role]))
        base += size
        role_base[role] = role_base.get(role, 0) + size
    return out


@dataclass(frozen=True)
class Assignment:
    """What rendezvous decided for this node for one attempt: ranks, master, restart state."""

    group_rank: int
    group_world_size: int
    base_global_rank: int
    global_world_size: int
    master_addr: str
    master_port: int
    run_id: str
    base_role_rank: Optional[int] = None  # None: same as base_global_rank (one role)
    role_world_size: Optional[int] = None  # None: same as global_world_size
    restart_count: int = 0
    max_restarts: int = 0
    use_agent_store: bool = False

    @classmethod
    def homogeneous(
        cls, group_rank: int, group_world_size: int, local_world_size: int, **kw: object
    ) -> "Assignment":
        """torch's fast path: every node runs ``local_world_size`` workers of one role."""
        base = group_rank * local_world_size
        world = group_world_size * local_world_size
        return cls(group_rank=group_rank, group_world_size=group_world_size,
                   base_global_rank=base, global_world_size=world, **kw)  # type: ignore[arg-type]

    @classmethod
    def from_node_ranks(cls, group_rank: int, group_world_size: int, ranks: NodeRanks,
                        **kw: object) -> "Assignment":
        return cls(group_rank=group_rank, group_world_size=group_world_size,
                   base_global_rank=ranks.base_global_rank,
                   global_world_size=ranks.global_world_size,
                   base_role_rank=ranks.base_role_rank, role_world_size=ranks.role_world_size,
                   **kw)  # type: ignore[arg-type]

    @property
    def role_base(self) -> int:
        return self.base_global_rank if self.base_role_rank is None else self.base_role_rank

    @property
    def role_size(self) -> int:
        return self.global_world_size if self.role_world_size is None else self.role_world_size

    def check(self, local_world_size: int) -> None:
        """Raise ``AssignmentError`` naming the first field that cannot hold these workers."""
        if not 0 <= self.group_rank < self.group_world_size:
            raise AssignmentError(
                f"group_rank {self.group_rank} is outside 0..{self.group_world_size - 1}")
        if self.base_global_rank < 0 or self.base_global_rank + local_world_size > self.global_world_size:
            raise AssignmentError(
                f"ranks {self.base_global_rank}..{self.base_global_rank + local_world_size - 1} "
                f"do not fit in global_world_size {self.global_world_size}")
        if self.role_base < 0 or self.role_base + local_world_size > self.role_size:
            raise AssignmentError(
                f"role ranks {self.role_base}..{self.role_base + local_world_size - 1} "
                f"do not fit in role_world_size {self.role_size}")
        if not 0 < self.master_port < 65536:
            raise AssignmentError(f"master_port {self.master_port} is not a TCP port (1-65535)")
        if not self.master_addr:
            raise AssignmentError("master_addr is empty; pass the host of rank 0")
        if not self.run_id:
            raise AssignmentError("run_id is empty; pass a job id (torchrun's --rdzv-id)")
        if self.restart_count < 0 or self.max_restarts < 0:
            raise AssignmentError("restart_count and max_restarts must be >= 0")

    def global_rank(self, local_rank: int) -> int:
        return self.base_global_rank + local_rank

    def role_rank(self, local_rank: int) -> int:
        return self.role_base + local_rank


# The agent's secrets: read by the launcher from its own environment, never handed to a worker
# (a worker runs user code, and its environment is readable by its children and in /proc).
WITHHELD = frozenset({"ELASTICTK_RDZV_TOKEN"})


def worker_env(
    assignment: Assignment,
    *,
    role: str,
    local_rank: int,
    local_world_size: int,
    error_file: Optional[str],
    base_env: Mapping[str, str],
    extra: Optional[Mapping[str, str]] = None,
    virtual_local_rank: bool = False,
) -> dict[str, str]:
    """The complete environment of one worker.

    Layers, later winning: ``base_env`` (the agent's environment), ``extra`` (the spec's env),
    then torchrun's variables. ``OMP_NUM_THREADS`` is only defaulted, and
    ``CUDA_VISIBLE_DEVICES`` is passed through untouched. :data:`WITHHELD` never passes.
    ``virtual_local_rank`` (torchrun's ``--virtual-local-rank``): :func:`virtual_devices`.
    """
    env = {k: v for k, v in base_env.items() if k not in WITHHELD}
    env.update({k: v for k, v in (extra or {}).items() if k not in WITHHELD})
    a = assignment
    env.update({
        "RANK": str(a.global_rank(local_rank)),
        "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": str(a.group_rank),
        "ROLE_RANK": str(a.role_rank(local_rank)),
        "ROLE_NAME": role,
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "WORLD_SIZE": str(a.global_world_size),
        "GROUP_WORLD_SIZE": str(a.group_world_size),
        "ROLE_WORLD_SIZE": str(a.role_size),
        "MASTER_ADDR": a.master_addr,
        "MASTER_PORT": str(a.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(a.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(a.max_restarts),
        "TORCHELASTIC_RUN_ID": a.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(a.use_agent_store),
        "TORCHELASTIC_ERROR_FILE": error_file or "",
    })
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if local_world_size > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    if virtual_local_rank:
        env.update(virtual_devices(local_rank, base_env.get("CUDA_VISIBLE_DEVICES")))
    return env


#: The worker's real local rank where ``LOCAL_RANK`` is virtual (always 0): elastictk's
#: per-worker slots (steps, timers, snapshots) are indexed by it.
ENV_SLOT = "ELASTICTK_LOCAL_RANK"


def virtual_devices(local_rank: int, visible: Optional[str]) -> dict[str, str]:
    """torch's virtual local rank: ``LOCAL_RANK=0`` in every worker, each seeing one GPU as
    device 0: the ``local_rank``-th of the agent's ``CUDA_VISIBLE_DEVICES`` (``local_rank``
    itself when unset). More workers than listed devices: :class:`AssignmentError`."""
    if visible is not None:
        devices = visible.split(",")
        if local_rank >= len(devices):
            raise AssignmentError(
                f"local_rank {local_rank} exceeds available GPUs in CUDA_VISIBLE_DEVICES={visible}")
        device = devices[local_rank].strip()
    else:
        device = str(local_rank)
    return {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": device, ENV_SLOT: str(local_rank)}


def slot_rank(environ: Mapping[str, str]) -> int:
    """This worker's index among its node's workers, for elastictk's per-worker slots: the
    real local rank, also under ``--virtual-local-rank``."""
    return int(environ.get(ENV_SLOT) or environ.get("LOCAL_RANK") or 0)

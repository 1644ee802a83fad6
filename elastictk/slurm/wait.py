"""Under Slurm's defaults a node that does not host the job's c10d store waits for the one that does.

Every task of an ``srun`` step starts at once, and the first node's agent needs a second or
two (importing torch) before its store listens. Every non-host waits ``read_timeout`` for its
host (:mod:`elastictk.store.wait`); under Slurm's defaults the wait is the rendezvous join
timeout instead, and any reason the store does not answer is waited out, since the endpoint
came from the allocation, not from a flag that could be mistyped.
"""
from __future__ import annotations

from typing import Callable

from ..store import wait
from ..store.endpoint import Endpoint
from ..store.listen import ping_store


def wait_for_store(endpoint: Endpoint, seconds: float, say: Callable[[str], None],
                   ping: Callable[[Endpoint, float], str | None] = ping_store) -> bool:
    """True once a TCPStore answers at ``endpoint``; False after ``seconds`` (the caller's
    own open then fails with its one line). Every reason not to answer is waited out here, not
    only a refused connect: under Slurm the endpoint is the allocation's first node, never a
    mistyped one. The loop itself is :func:`elastictk.store.wait.wait_for_store`'s."""
    return wait.wait_for_store(endpoint, seconds, say, probe=lambda e, t: (ping(e, t), True),
                               setting="--rdzv-conf join_timeout") is None

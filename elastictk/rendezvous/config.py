"""Rendezvous settings, validated once so bad values fail at start-up, not mid-job."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RendezvousConfig:
    """How a job forms its membership rounds.

    ``last_call`` is how long the closer keeps a round open for more nodes once ``min_nodes``
    are in (a round with ``max_nodes`` closes at once); ``join_timeout`` bounds how long a node
    waits for a round to form; a node whose heartbeat counter has not moved for
    ``heartbeat_timeout`` seconds (measured on the observer's own monotonic clock, so skewed
    wall clocks do not matter) is considered lost.
    """

    job_id: str
    min_nodes: int = 1
    max_nodes: int = 1
    last_call: float = 30.0
    join_timeout: float = 600.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    # The job-wide secret (--rdzv-token): records are signed with it and nodes without it are
    # refused. None: nothing is signed, as in torchrun.
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        problems = []
        if not self.job_id or "/" in self.job_id:
            problems.append(f"job id {self.job_id!r} must be non-empty and contain no '/'")
        if self.min_nodes < 1:
            problems.append(f"min_nodes={self.min_nodes} must be at least 1")
        if self.max_nodes < self.min_nodes:
            problems.append(
                f"min_nodes={self.min_nodes} > max_nodes={self.max_nodes}: use MIN:MAX with MIN <= MAX"
            )
        for name in ("last_call", "join_timeout", "heartbeat_interval", "heartbeat_timeout"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must not be negative")
        if self.heartbeat_interval <= 0:
            problems.append("heartbeat_interval must be positive")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            problems.append(
                f"heartbeat_timeout={self.heartbeat_timeout} must exceed "
                f"heartbeat_interval={self.heartbeat_interval}"
            )
        if self.token is not None and not self.token.strip():
            # an empty secret would sign nothing and refuse nobody, silently: say so instead
            problems.append("token is empty: give the job's secret, or token=None for a job "
                            "without authentication")
        if problems:
            raise ValueError("invalid rendezvous config: " + "; ".join(problems))

"""How the agent ends (:class:`AgentResult`), and its closed sets of answers: how a round ended,
how the agent ended, how it recovers, and what the job decided after a failure.

``ResultState``, ``Recovery`` and ``DecisionAction`` are ``str``-valued: their values are what
launchers print, ``--recovery`` takes and the store's decision record holds, and a member
compares equal to its value (``result.state == "succeeded"``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ..supervisor.report import FailureReport


class _Text(str, enum.Enum):
    """A str-valued member whose ``str()`` (and so ``%s`` and f-strings) is its plain value."""

    def __str__(self) -> str:
        return str(self.value)


class Outcome(enum.Enum):
    """Why ``ElasticAgent``'s monitor woke the loop: how the round ended for this node."""

    SUCCEEDED = enum.auto()  # every local worker finished
    LOCAL_FAILURE = enum.auto()  # a local worker failed
    PEER_FAILURE = enum.auto()  # another node reported a failure first
    MEMBERSHIP = enum.auto()  # a node joined or was lost: a new round forms
    SIGNAL = enum.auto()  # the agent was told to stop
    INPLACE_FALLBACK = enum.auto()  # in-place recovery failed: restart everything
    UNHEALTHY = enum.auto()  # --health-check failed in the round: this node leaves as failed
    EXCLUDED = enum.auto()  # the leader excluded this node (a straggler): it leaves as failed


class ResultState(_Text):
    """How the agent ended (``AgentResult.state``)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    FINISHED_ELSEWHERE = "finished-elsewhere"  # the job was over before this node joined
    SIGNALLED = "signalled"
    PREEMPTED = "preempted"  # the pre-emption signal: workers stopped, run the job again (preempt.py)


class Recovery(_Text):
    """What a worker's failure costs (``--recovery``)."""

    RESTART_ALL = "restart-all"  # every worker of the job restarts (torchrun's behaviour)
    IN_PLACE = "in-place"  # only the failed worker is replaced (see agent/inplace.py)


class DecisionAction(_Text):
    """What the job does after a round's failure (``Decision.action``, in the store as JSON)."""

    RESTART = "restart"
    GIVE_UP = "give_up"


@dataclass
class AgentResult:
    """How the agent ended; ``exit_code`` is what a launcher should exit with."""

    state: ResultState  # compares equal to its value: "succeeded", "failed", ...
    exit_code: int
    message: str
    report: FailureReport | None = None
    return_values: dict[int, Any] = field(default_factory=dict)
    restarts: int = 0
    attempts: int = 0
    recovery_summary: str | None = None  # where recovery time went (agent/recovery.py), if any

"""``--slurm-drain``: a node this agent takes out of the job is drained in Slurm too, so a
requeued job (or the next one) is not placed on it again.

Listens to the agent's own events: ``node_excluded`` (``--exclude-after``, or a straggler
excluded by the leader; served by the excluded node itself) and ``health_check_failed``
(``--health-check``). The first one drains the node (``scontrol update NodeName=X
State=DRAIN Reason="elastictk: ..."``, :mod:`elastictk.slurm.scontrol`); how that went is one
log line, and the job goes on either way. One try per agent: a check that keeps failing does
not call scontrol every interval, and a refusal (no operator rights) is said once.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from ..metrics.kinds import Emit, EventKind
from ..slurm.scontrol import Answer, drain

log = logging.getLogger("elastictk.agent")


def _reason(kind: EventKind, fields: dict[str, Any]) -> str | None:
    if kind == EventKind.NODE_EXCLUDED:
        return f"excluded ({fields.get('reason', '?')}: {fields.get('detail', '')})"
    if kind == EventKind.HEALTH_CHECK_FAILED:
        return f"health check failed ({fields.get('exit', '?')}: {fields.get('line') or 'no output'})"
    return None


def drain_on_exclusion(node: str, then: Emit | None = None,
                       ask: Callable[[str, str], Answer] = drain) -> Emit:
    """An ``on_event`` that drains ``node`` at the first exclusion or failed health check, then
    hands every event on to ``then``."""
    tried = False

    def emit(kind: EventKind, **fields: Any) -> None:
        nonlocal tried
        reason = _reason(kind, fields)
        if reason is not None and not tried:
            tried = True
            answer = ask(node, reason)
            log.log(logging.WARNING if not answer.ok else logging.INFO, "--slurm-drain: %s", answer.line)
        if then is not None:
            then(kind, **fields)

    return emit

"""The steps block the agent reads: which one, what the workers need to count into it, and
whether the current attempt made a step.

Apart from the loop because it is one question asked in three places (the workers'
environment at the start, the crash-loop count on a failure, the straggler watch): a worker
counts its steps through a hook into a shared block, and the agent owns that block only when
nobody handed it one.
"""
from __future__ import annotations

import os
from typing import Mapping

from ..metrics.steps import WorkerStepsBlock
from ..metrics.worker import ENV_HOOKS


def steps_env(block: WorkerStepsBlock | None, base: Mapping[str, str]) -> dict[str, str]:
    """What workers need to count their steps in ``block`` (none for no block): its path, and
    its hook added to the hooks they would get from ``base`` or this process."""
    if block is None:
        return {}
    env = block.env()
    names = [n for n in (base.get(ENV_HOOKS) or os.environ.get(ENV_HOOKS, "")).split(",") if n.strip()]
    names += [n for n in env[ENV_HOOKS].split(",") if n not in names]
    return {**env, ENV_HOOKS: ",".join(names)}


def steps_block(given: WorkerStepsBlock | None, needed: bool,
                local_world_size: int) -> tuple[WorkerStepsBlock | None, WorkerStepsBlock | None]:
    """(the block the crash-loop count and the straggler watch read, the block made here to be
    closed by the caller): the caller's, else, when ``needed``, one of our own (the progress
    watchdog then uses it too); none when nothing reads it."""
    if given is not None or not needed:
        return given, None
    own = WorkerStepsBlock(local_world_size)
    return own, own


def stepped(steps: WorkerStepsBlock | None, pids: set[int]) -> bool | None:
    """Whether a worker of the attempt (``pids``, as started) completed a step (its slot is
    owned by it and counts a step of its own); None when no steps block is read."""
    if steps is None:
        return None
    return any(s.owner in pids and s.proc_steps > 0 for s in steps.snapshot())

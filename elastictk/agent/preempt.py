"""Pre-emption: the scheduler's warning that it will end the job (Slurm's ``--signal``).

The agent forwards the warning signal to its workers, as torchrun's ``--signals-to-handle``
does, so a script that handles it can commit its step and end (``destroy_process_group``
writes the newest commit to the disk tier, docs/snapshots.md); the workers get the grace period
to end on their own, then the ones left are stopped (SIGTERM, then SIGKILL). The agent then
exits :data:`PREEMPTED_EXIT`, which means "stopped on purpose, run me again": a requeued job
resumes from the disk tier's newest complete step, which the result names.

A worker killed by the forwarded signal (a script that does not handle it) is not a failure
here: the job was told to end.
"""
from __future__ import annotations

import logging
import re
import signal
from pathlib import Path

from ..metrics.kinds import Emit, EventKind
from ..supervisor.group import WorkerGroup
from .outcome import AgentResult, ResultState

log = logging.getLogger("elastictk.agent")

#: ``EX_TEMPFAIL`` of sysexits.h: a temporary failure, the caller is invited to retry.
PREEMPTED_EXIT = 75
_STEP = re.compile(r"step-([0-9]{1,18})")


def newest_complete_step(snapshot_dir: str | None) -> int | None:
    """The newest ``step-N`` of the disk tier holding its ``COMPLETE`` mark (names only: what a
    relaunch will look at first; its restore verifies the files)."""
    if not snapshot_dir:
        return None
    steps = []
    try:
        for d in Path(snapshot_dir).iterdir():
            m = _STEP.fullmatch(d.name)
            if m and (d / "COMPLETE").is_file():
                steps.append(int(m.group(1)))
    except OSError:
        return None
    return max(steps, default=None)


def preempt(group: WorkerGroup, sig: int, grace: float, emit: Emit, snapshot_dir: str | None,
            attempts: int) -> AgentResult:
    """Forward ``sig``, give the workers ``grace`` seconds to end, stop the rest; the result."""
    name = signal.Signals(sig).name
    running = len(group.running)
    emit(EventKind.SIGNALLED, signal=name, preempted=True)
    log.warning("pre-empted (%s): forwarded to %d worker(s); they have %gs to end before they "
                "are stopped", name, running, grace)
    own = 0
    if running:
        group.signal_all(sig)
        group.wait(timeout=grace)  # each worker's exit wakes it; no polling
        own = running - len(group.running)
        if group.running:
            group.stop()
    step = newest_complete_step(snapshot_dir)
    disk = ("" if snapshot_dir is None else
            f"; the disk tier's newest complete step is {step}" if step is not None else
            "; the disk tier holds no complete step")
    return AgentResult(
        ResultState.PREEMPTED, PREEMPTED_EXIT,
        f"pre-empted by {name}: {own} of {running} worker(s) ended within the grace period"
        f"{'' if own == running else ', the rest were stopped'}{disk}; exit {PREEMPTED_EXIT} means "
        "run the job again (it resumes from the newest complete snapshot)", attempts=attempts)

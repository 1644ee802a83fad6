"""The stop sequence: a signal to every worker's whole tree, a grace period, then SIGKILL.

Apart from ``group.py`` because it is the one place that decides how hard and how long to push
a process tree before giving up on it; the group only says which sessions and how to see exits.

The order matters: the signal (and SIGCONT, so a frozen worker acts on it at once rather than
sitting out the grace period), then up to ``grace`` seconds for every exit, then SIGKILL to
whatever is left, then a last sweep for descendants orphaned while their parents were killed.
"""
from __future__ import annotations

import signal
import time
from typing import Callable, Sequence

from ..lifetime.reaper import TrackedSession, reap_orphans, signal_trees, wait_gone

KILL_WAIT = 30.0
"""How long the sequence waits for SIGKILLed processes (and the group for tee pipes to drain);
past this something is stuck in the kernel (D state) and waiting longer would only hang the agent."""


def escalate(sessions: Sequence[TrackedSession], sig: int, grace: float,
             wait_exits: Callable[[float], object]) -> None:
    """Stop every process of ``sessions``: ``sig`` (with ``grace`` > 0), SIGKILL, a last sweep.

    ``wait_exits(deadline)`` waits until every worker's exit was seen or the monotonic
    ``deadline``; workers are reaped by their own objects, other orphans here.
    """
    deadline = time.monotonic() + grace
    if grace > 0:
        tree = signal_trees(sessions, sig)
        if sig != signal.SIGCONT:
            # A frozen worker (SIGSTOP, a fault, a debugger) acts on the signal only once
            # it runs again; without this it would sit out the whole grace period.
            for session in sessions:
                session.signal(signal.SIGCONT)
        wait_exits(deadline)
        wait_gone(tree, max(0.0, deadline - time.monotonic()))
    signal_trees(sessions, signal.SIGKILL)
    wait_exits(time.monotonic() + KILL_WAIT)
    # A last sweep: descendants orphaned while we were killing their parents.
    leftovers = signal_trees(sessions, signal.SIGKILL)
    wait_gone(leftovers, KILL_WAIT)
    reap_orphans()  # workers are reaped by their own objects (claimed)

"""``run_elastic``: a training loop whose process group outlives the death of any peer.

Under ``elastictk-run --recovery in-place`` the agent hosts a store that outlives every worker
and publishes *generations* there (see ``protocol``). Each step runs ``train_step(state, ctx)``
and commits the state in memory. When a collective raises because a peer died (gloo: the
connection resets; a hung peer: the collective times out and the agent kills the frozen
process), the worker does not exit: it says so in the store, rolls back to the last commit,
tears its process group down (NCCL: aborts the communicator first, so no kernel stays queued
on a dead peer), waits for the agent to publish the next generation (the failed rank replaced,
forked from the preload server), forms the new group under that generation's fresh store
prefix, and syncs the state: the rank holding the newest commit broadcasts it to every rank
that is behind, including the replacement, which has none. Then training continues.

Data follows the world size: ``ctx.shard(n)`` gives this rank's part of ``[0, n)`` as a function
of (n, rank, world size) alone, so with samples addressed by global index no sample is skipped
or repeated across a change.

Outside such an agent (torchrun, or elastictk-run's default restart-all) ``run_elastic`` forms
the group from the usual environment and runs the same loop without recovery: a failure ends
the worker as in any script, and the launcher restarts the job.

Snapshot tiers (``--snapshot local|disk``, docs/snapshots.md): every commit also lands there,
and whenever a group forms with no rank holding a commit (a job's start, a restart-all, every
worker of a generation lost at once) the ranks ``state.restore()`` together, so a restarted job
resumes from the newest step every rank holds whole instead of step 0.
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Callable, Optional

import torch.distributed as dist

from ..data import record as data_record
from .protocol import is_peer_failure
from .session import Context as Context, RecoveryError as RecoveryError, Session, first_line, say
from .state import State

DEFAULT_COLLECTIVE_TIMEOUT = 30.0
ENV_COLLECTIVE_TIMEOUT = "ELASTICTK_COLLECTIVE_TIMEOUT"
ENV_HOOKS = "ELASTICTK_WORKER_HOOKS"  # modules told of each step (fault injection, metrics)

StepFn = Callable[[State, Context], Any]
JoinFn = Callable[[State, Context], None]


def run_elastic(state: State, train_step: StepFn, *, steps: Optional[int] = None,
                done: Optional[Callable[[State], bool]] = None, backend: str = "gloo",
                collective_timeout: Optional[float] = None,
                on_join: Optional[JoinFn] = None) -> Context:
    """Run ``train_step(state, ctx)`` until ``state.step >= steps`` (or ``done(state)``).

    ``train_step`` does one step on the default process group (``dist.all_reduce(...)`` as in
    any script) and advances ``state.step``; ``run_elastic`` commits after each step. Each step
    is reported to the modules named in ``ELASTICTK_WORKER_HOOKS`` (``on_loop_step``: a chaos
    run's fault injector before it runs, the metrics' step counter after its commit).
    ``on_join(state, ctx)`` runs after every group formation (the first too), with the state
    already synced: a place to log or rebuild derived objects. Returns the last context; the
    process group is destroyed on return.
    """
    if steps is None and done is None:
        raise ValueError("run_elastic needs steps=N (runs until state.step >= N) or done=fn(state)")
    finished = done if done is not None else (lambda s: int(s.step) >= int(steps))  # type: ignore[arg-type]
    timeout = float(collective_timeout if collective_timeout is not None
                    else os.environ.get(ENV_COLLECTIVE_TIMEOUT, DEFAULT_COLLECTIVE_TIMEOUT))
    # No commit yet: the state is restored (snapshot tiers) or committed once the group forms,
    # not here: a commit now would take one of the two local slots that a restore may need.
    # Here a collective that runs past the timeout is a recoverable error (the group times
    # out, the agent kills the frozen peer, the survivors re-form), not a hang for the
    # watchdog to kill: the same --collective-timeout sets the group's timeout instead.
    from .. import timer

    timer.unwatch_collectives()
    session = Session.from_env(backend, timeout)
    ctx = session.join(state, after=None)
    if not state.committed:
        state.commit()
    if on_join is not None:
        on_join(state, ctx)
    hooks = _step_hooks()
    recording = data_record.on()
    while True:
        failure: Optional[str] = None
        moved = False
        try:
            while not finished(state):
                if recording:  # the data a chaos run judges: which step each batch trains in
                    data_record.at_step(int(state.step) + 1, ctx.restart_count, ctx.world_size)
                for hook in hooks:
                    hook(int(state.step), rank=ctx.rank, restart_count=ctx.restart_count,
                         finished=False)
                train_step(state, ctx)
                state.commit()
                for hook in hooks:
                    hook(int(state.step), rank=ctx.rank, restart_count=ctx.restart_count,
                         finished=True)
                if session.superseded(ctx.generation):
                    moved = True  # nodes join: the world grows at this commit point
                    break
            else:
                # The end is a step too: a peer lost before every rank got here is recovered,
                # so no rank exits while the others still need it.
                dist.barrier()
                moved = not session.finish(ctx)
        except RuntimeError as e:
            if not session.recoverable or not is_peer_failure(e):
                session.close()
                raise
            failure = first_line(e)
        if failure is None and not moved:
            break
        # Out of the except block: the traceback's frames (holding the failed collective's work
        # and group) are gone, so tearing the group down really closes its connections, and a
        # peer still blocked on one of them fails now instead of at its timeout.
        if failure is not None:
            session.report_error(ctx, failure)
        else:
            session.leave(ctx)
        state.rollback()
        ctx = session.join(state, after=ctx.generation)
        if on_join is not None:
            on_join(state, ctx)
    session.close()
    return ctx


def _step_hooks() -> list[Callable[..., None]]:
    """``on_loop_step`` of each ``elastictk.*`` module named in ``ELASTICTK_WORKER_HOOKS``, by
    name (this package imports neither fault injection nor metrics)."""
    out = []
    for name in (n.strip() for n in os.environ.get(ENV_HOOKS, "").split(",")):
        if not name.startswith("elastictk."):
            continue
        try:
            fn = getattr(importlib.import_module(name), "on_loop_step", None)
        except ImportError as e:
            say(f"elastictk: steps are not reported to {name}: {e}")
            continue
        if callable(fn):
            out.append(fn)
    return out

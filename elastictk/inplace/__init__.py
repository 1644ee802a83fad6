"""In-place recovery, worker side: survivors keep training, only the failed rank is replaced.

::

    from elastictk.inplace import State, run_elastic

    state = State(model=model, optimizer=opt, step=0)

    def train_step(state, ctx):
        for i in ctx.shard(GLOBAL_BATCH): ...       # samples by global index
        ...; dist.all_reduce(grad); opt.step()
        state.step += 1

    run_elastic(state, train_step, steps=100)       # elastictk-run --recovery in-place ...

Opt-in: plain torchrun scripts keep working under every launcher and mode.
"""
from __future__ import annotations

from typing import Any

from .protocol import Generation, is_peer_failure, shard
from .state import State, StateError

__all__ = ["State", "StateError", "run_elastic", "Context", "RecoveryError", "Generation",
           "shard", "is_peer_failure"]

_LAZY = {"run_elastic", "Context", "RecoveryError"}


def __getattr__(name: str) -> Any:
    """The loop imports torch.distributed; the agent reads ``protocol`` without it."""
    if name in _LAZY:
        from . import loop

        return getattr(loop, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

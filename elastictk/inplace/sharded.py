"""A model and its optimizer as one stateful entry, for sharded (FSDP2) training.

Why a pair: an optimizer's own ``state_dict()`` keys its state by parameter number and holds
none before its first step, so a fresh process (a restart, a new world size) has no DTensors in
it for the disk tier to reshard into. DCP's ``get_state_dict`` creates the optimizer's state
(a step with zero gradients and no learning rate) and keys it by parameter name; its
``set_state_dict`` loads it back onto the current mesh. ``State(train=Sharded(model, opt),
step=0)`` then snapshots, restores and reshards both through every tier.
"""
from __future__ import annotations

from typing import Any


class Sharded:
    """``state_dict``/``load_state_dict`` of ``model`` and ``optimizer`` through
    ``torch.distributed.checkpoint.state_dict`` (works for plain, DDP and FSDP2 modules)."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

"""A sharded (FSDP2) model and its optimizer that are rebuilt on each generation's mesh.

Why rebuilt: ``fully_shard`` binds a module to the device mesh, hence the process group, it was
built on. Under ``run_elastic`` every generation has a new group (the old one is destroyed when
a peer dies), so the old module can neither gather its parameters nor save them; a new one has
to be built on the new mesh and the state moved into it.

Why the *full* state travels: a shard lives in one process only. When a rank is SIGKILLed and
replaced in place, its shard dies with it, and the survivors' shards do not cover it; the
replacement can only get its part from what the survivors hold. So the commit of this entry is
the full (gathered) state dict, through DCP's ``get_state_dict(full_state_dict=True)``: plain
tensors every rank holds whole, which ``run_elastic`` already broadcasts to a replacement and
every snapshot tier already keeps (the disk tier as replicated tensors, readable at any world
size). Loading it (``set_state_dict(full_state_dict=True)``) slices each rank's shard out of
the full tensors on the new mesh. The price: each commit all-gathers the model and optimizer,
and each rank's commit holds the whole of them, so it suits models whose full state fits in a
host's memory (``Sharded`` keeps commits sharded, for the disk tier alone).

When it is rebuilt: ``load_state_dict`` only keeps the state (a rollback runs after the failed
group is torn down, when no collective can run) and drops the stale module; the next use of
``model``, ``optimizer`` or ``state_dict()`` builds anew on the current group and loads it. Every
rank reaches that first use at the same point of the same step, so the collectives of the
load (``distribute_tensor``) line up on the new group.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

Build = Callable[[], tuple[Any, Any]]


class Rebuilt:
    """``state_dict``/``load_state_dict`` of a sharded model and optimizer made by ``build()``.

    ``build`` returns ``(model, optimizer)``: the module ``fully_shard``-ed on the current
    default process group and its optimizer. It runs at the first use and again after every
    load (a new generation, a restore); its initial weights matter only at the job's first start.
    """

    def __init__(self, build: Build) -> None:
        self._build = build
        self._model: Optional[Any] = None
        self._optimizer: Optional[Any] = None
        self._pending: Optional[dict[str, Any]] = None

    @property
    def model(self) -> Any:
        self._ready()
        return self._model

    @property
    def optimizer(self) -> Any:
        self._ready()
        return self._optimizer

    def _ready(self) -> None:
        if self._model is not None:
            return
        self._model, self._optimizer = self._build()
        if self._pending is not None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            pending, self._pending = self._pending, None
            set_state_dict(self._model, self._optimizer, model_state_dict=pending["model"],
                           optim_state_dict=pending["optim"],
                           options=StateDictOptions(full_state_dict=True))

    def state_dict(self) -> dict[str, Any]:
        """The full state (a collective: every rank gathers every shard), on the CPU."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # cpu_offload would leave the full state on rank 0 only; a survivor of any rank must
        # hold it whole, so it is gathered on every rank and moved to the CPU here.
        model, optim = get_state_dict(self.model, self.optimizer,
                                      options=StateDictOptions(full_state_dict=True))
        return {"model": _to_cpu(model), "optim": _to_cpu(optim)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep the full state for the next build; the current module is dropped (it may be
        bound to a group that no longer exists)."""
        if not isinstance(state, dict) or "model" not in state or "optim" not in state:
            raise ValueError("Rebuilt.load_state_dict: expected the {'model', 'optim'} full state "
                             "that Rebuilt.state_dict() returns; was the entry registered under "
                             "another name or type before?")
        self._pending = state
        self._model = self._optimizer = None


def _to_cpu(tree: Any) -> Any:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_cpu(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_to_cpu(v) for v in tree)
    return tree

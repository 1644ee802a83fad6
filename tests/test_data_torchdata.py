"""torchdata's StatefulDataLoader over an ElasticSampler, where torchdata is installed (it is
not a dependency): its state_dict carries the sampler's position through a State, and a loader
restored at another world size takes the rest of the epoch once."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from elastictk.data import ElasticSampler
from elastictk.inplace import State

stateful = pytest.importorskip("torchdata.stateful_dataloader")


def _loader(rank: int, world: int, workers: int) -> tuple[object, ElasticSampler]:
    ds = TensorDataset(torch.arange(48))
    s = ElasticSampler(ds, num_replicas=world, rank=rank, seed=3, batch_size=2)
    return stateful.StatefulDataLoader(ds, batch_size=2, sampler=s, num_workers=workers), s


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_loader_in_the_state_resumes_at_another_world_size(workers: int) -> None:
    taken: list[int] = []
    saved = []
    for rank in range(2):
        loader, _ = _loader(rank, 2, workers)
        state = State(loader=loader)
        it = iter(loader)
        for _ in range(3):
            taken += next(it)[0].tolist()
        state.commit()
        saved.append(state.to_bytes())
        del it
    for rank in range(3):
        loader, s = _loader(rank, 3, workers)
        State(loader=loader).load_bytes(saved[0])
        taken += [i for (b,) in loader for i in b.tolist()]
    assert sorted(taken) == list(range(48))

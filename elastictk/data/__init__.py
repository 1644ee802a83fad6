"""Exactly-once data across recoveries: a sampler whose place in the epoch is part of the state.

::

    from elastictk.data import DataLoader, ElasticSampler     # was: torch's DataLoader, DistributedSampler

    sampler = ElasticSampler(dataset, shuffle=True, seed=0)   # same arguments
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=2)
    state = State(model=model, optimizer=opt, sampler=sampler)
    state.restore()                                            # at the next untrained sample
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            ...; state.commit()

docs/data.md says what is exact and what is not.
"""
from __future__ import annotations

from .loader import DataLoader
from .plan import Cut, cut, order
from .sampler import ElasticSampler, SamplerStateError, check_state

__all__ = ["ElasticSampler", "DataLoader", "SamplerStateError", "check_state", "Cut", "cut", "order"]

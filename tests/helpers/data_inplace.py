"""tests/helpers/data_train.py's DDP job over ``elastictk.data`` driven by ``run_elastic`` (in-place
recovery), for tests/test_data_inplace.py.

The sampler is in the ``State``: a rollback (survivors) or a peer's commit (the replacement)
puts it back at the first untrained sample, and the live ``DataLoader`` iterator (2 workers)
follows. The batches come from one generator over epochs that reads the epoch from the sampler,
so a rollback into the previous epoch finishes that epoch again before the next one starts.
DDP is rebuilt on every group formation (it holds the group it was made with). Every rank
appends, after each step it trained, ``{"step", "epoch", "rank", "gen", "indices"}`` to
``--record``; rank 0 saves the final weights to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Iterator

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.helpers.data_train import Numbers  # noqa: E402  (the same samples)

from elastictk.data import DataLoader, ElasticSampler  # noqa: E402
from elastictk.inplace import State, run_elastic  # noqa: E402
from elastictk.inplace.loop import Context  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--record", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=44)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    a = p.parse_args()
    torch.manual_seed(1234 + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset, epochs = Numbers(a.samples), a.epochs
    sampler = ElasticSampler(dataset, seed=7, batch_size=a.batch)
    loader = DataLoader(dataset, batch_size=a.batch, sampler=sampler, num_workers=2)
    state = State(model=model, optimizer=opt, sampler=sampler, step=0)
    held: dict[str, Any] = {}

    def batches() -> Iterator[Any]:
        while sampler.epoch < epochs:
            yield from loader                       # follows a rollback inside the epoch
            sampler.set_epoch(sampler.epoch + 1)    # the epoch the loader just ended, plus one

    feed = batches()

    def on_join(state: State, ctx: Context) -> None:  # on every group formation
        held["ddp"] = DDP(model)                      # DDP holds the group it was made with

    def done(state: State) -> bool:
        last = epochs - 1
        return sampler.epoch > last or (sampler.epoch == last and sampler.position >= len(dataset))

    def train_step(state: State, ctx: Context) -> None:
        idx, x, y = next(feed)
        epoch = sampler.epoch
        opt.zero_grad()
        (held["ddp"](x) - y).pow(2).mean().backward()
        opt.step()
        state.step += 1
        with open(a.record, "a") as rec:
            rec.write(json.dumps({"step": state.step, "epoch": epoch, "rank": ctx.rank,
                                  "gen": ctx.generation, "indices": idx.tolist()}) + "\n")

    ctx = run_elastic(state, train_step, done=done, on_join=on_join)
    next(feed, None)  # the loader sees the last epoch's end
    if ctx.rank == 0:
        torch.save(model.state_dict(), a.out)


if __name__ == "__main__":
    main()

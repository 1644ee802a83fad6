"""FSDP2 (``fully_shard``, CPU + gloo) under ``run_elastic`` with ``--recovery in-place``.

Real ``elastictk-run --standalone --nproc-per-node 2`` jobs. The model and its Adam optimizer
are registered as ``elastictk.inplace.fsdp.Rebuilt(build)``; ``build`` seeds with ``1234 + the
process's restart count``, so a replacement starts from other weights and only the state moved
into its rebuilt model can give the fault-free ones. At step 3 of the first processes rank 1 (or
0) is SIGKILLed (replaced in place: the survivor sends the full state); with ``--kill-all`` both ranks
then die at step 5 after a barrier (no survivor: the local snapshot tier restores). The job
ends with rank 0's gathered full weights and Adam moments, compared with ``torch.equal`` to a
fault-free run's. The failing side: the same job whose entry drops the state it is given
(``NO_MOVE``) ends with other weights.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.inplace.fsdp import Rebuilt
from tests.helpers.unformed import unformed_reports

ROOT = Path(__file__).resolve().parent.parent
STEPS = 8

JOB = r'''
import argparse, json, os, signal
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from elastictk import State, run_elastic
from elastictk.inplace.fsdp import Rebuilt

p = argparse.ArgumentParser()
p.add_argument("--out"); p.add_argument("--record")
p.add_argument("--kill", type=int, default=-1)      # rank --victim of the first processes dies here
p.add_argument("--victim", type=int, default=1)
p.add_argument("--kill-all", type=int, default=-1)  # every rank of generation 1 dies here
a = p.parse_args()
started = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

def build():
    torch.manual_seed(1234 + started)               # a replacement's own weights differ
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)

class Dropping(Rebuilt):                            # the failing side: the state is not moved
    def load_state_dict(self, state):
        self._model = self._optimizer = None

train = (Dropping if os.environ.get("NO_MOVE") else Rebuilt)(build)
state = State(train=train, step=0)

def on_join(state, ctx):
    with open(a.record, "a") as f:
        f.write(json.dumps({"rank": ctx.rank, "pid": os.getpid(), "started": started,
                            "restart": ctx.restart_count, "gen": ctx.generation,
                            "start": state.step}) + "\n")

def train_step(state, ctx):
    s = state.step
    if (s, ctx.restart_count, ctx.rank) == (a.kill, 0, a.victim):
        os.kill(os.getpid(), signal.SIGKILL)
    if (s, ctx.restart_count) == (a.kill_all, 1):
        dist.barrier()                              # every rank has committed step s
        os.kill(os.getpid(), signal.SIGKILL)
    model, opt = train.model, train.optimizer       # this generation's
    g = torch.Generator().manual_seed(s * 100 + ctx.rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
    opt.zero_grad()
    (model(x) - y).pow(2).mean().backward()         # FSDP2 reduce-scatters the gradients
    opt.step()
    state.step = s + 1
    if state.step == STEPS:                         # the full weights and Adam state, gathered
        full = train.state_dict()
        if ctx.rank == 0:
            torch.save(full, a.out)

STEPS = ''' + str(STEPS) + r'''
ctx = run_elastic(state, train_step, steps=STEPS, on_join=on_join)
'''


def launch(tmp: Path, tag: str, *flags: str, env: dict[str, str] | None = None,
           kill: int = -1, kill_all: int = -1, victim: int = 1) -> tuple[int, str, list[dict]]:
    work = tmp / tag
    work.mkdir()
    script = tmp / "fsdpjob.py"
    if not script.exists():
        script.write_text(JOB)
    cmd = [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "2", "--recovery", "in-place", "--log-dir", str(work / "logs"),
           *flags, str(script), "--out", str(work / "weights.pt"),
           "--record", str(work / "record.jsonl"), "--kill", str(kill), "--kill-all", str(kill_all),
           "--victim", str(victim)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    path = work / "record.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    # A generation that never formed: where each worker was, for the failure message's tail.
    return proc.returncode, proc.stdout + proc.stderr + unformed_reports(work / "logs"), recs


def final(work: Path) -> dict:
    return torch.load(work / "weights.pt", weights_only=True)


def tensors(tree: object, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a full state, by its path (weights, Adam's step and moments)."""
    if isinstance(tree, torch.Tensor):
        return {path: tree}
    if isinstance(tree, dict):
        return {k: v for key in sorted(tree, key=str) for k, v in tensors(tree[key], f"{path}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, x in enumerate(tree) for k, v in tensors(x, f"{path}/{i}").items()}
    return {}


def same(a: dict, b: dict) -> bool:
    ta, tb = tensors(a), tensors(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("ref")
    code, out, recs = launch(tmp, "ref")
    assert code == 0, out[-3000:]
    assert [r["gen"] for r in recs] == [0, 0], recs
    ref = final(tmp / "ref")
    moments = [k for k in tensors(ref) if k.endswith("exp_avg_sq")]
    assert len(moments) == 4, sorted(tensors(ref))  # two Linear layers' weight and bias
    return ref


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_is_replaced_in_place_and_ends_with_the_fault_free_weights(
        tmp_path: Path, reference: dict, victim: int) -> None:
    """Rank 0 too: then rank 1's commit is what travels (each rank holds the full state)."""
    code, out, recs = launch(tmp_path, "kill", kill=3, victim=victim)
    assert code == 0, out[-3000:]
    assert "inplace_recovered" in out and "inplace_fallback" not in out, out[-3000:]
    rejoined = [r for r in recs if r["gen"] == 1]
    # the survivor kept its process; the replacement (another seed) got step 3 from it
    assert sorted((r["rank"], r["started"], r["start"]) for r in rejoined) == sorted(
        [(victim, 1, 3), (1 - victim, 0, 3)]), recs
    assert same(final(tmp_path / "kill"), reference)


def test_with_the_local_tier_a_replaced_rank_then_every_rank_lost_ends_with_the_fault_free_weights(
        tmp_path: Path, reference: dict) -> None:
    code, out, recs = launch(tmp_path, "tier", "--snapshot", "local", kill=3, kill_all=5)
    assert code == 0, out[-3000:]
    assert out.count("restored step 5 from local memory") == 2, out[-3000:]  # nobody survived
    assert {r["start"] for r in recs if r["started"] >= 2} == {5}, recs
    assert same(final(tmp_path / "tier"), reference)


def test_with_the_disk_tier_alone_every_rank_lost_restores_a_disk_step_and_the_fault_free_weights(
        tmp_path: Path, reference: dict) -> None:
    """The full state goes through DCP as replicated tensors (steps 2 and 4 written; step 4 may
    still be in flight when both ranks die, then step 2 is the newest complete one)."""
    code, out, recs = launch(tmp_path, "disk", "--snapshot-dir", str(tmp_path / "snaps"),
                             "--snapshot-every", "2", kill=3, kill_all=5)
    assert code == 0, out[-3000:]
    starts = {r["start"] for r in recs if r["started"] >= 2}
    assert len(starts) == 1 and starts <= {2, 4}, (recs, out[-3000:])
    assert out.count(f"restored step {starts.pop()} from disk") == 2, out[-3000:]
    assert same(final(tmp_path / "disk"), reference)


def test_control_without_moving_the_state_into_the_rebuilt_model_the_weights_differ(
        tmp_path: Path, reference: dict) -> None:
    code, out, recs = launch(tmp_path, "nomove", env={"NO_MOVE": "1"}, kill=3)
    assert code == 0, out[-3000:]
    assert "inplace_recovered" in out, out[-3000:]
    assert not same(final(tmp_path / "nomove"), reference)


def test_the_fsdp2_recipe_in_the_docs_ends_with_the_fault_free_weights(tmp_path: Path) -> None:
    """docs/snapshots.md's FSDP2 under run_elastic (the docs test runs it with its faults); here
    against the same script without faults, weights compared exactly (printed floats)."""
    text = (ROOT / "docs" / "snapshots.md").read_text()
    section = text[text.index("### FSDP2 under `run_elastic`"):]
    script = tmp_path / "fsdp_recipe.py"
    script.write_text(section.split("```python\n", 1)[1].split("```", 1)[0])
    finals = []
    for faults in (True, False):
        cmd = [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "2", "--recovery", "in-place", "--snapshot", "local",
               "--log-dir", str(tmp_path / f"logs{faults}"), str(script)]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180,
                              env={**os.environ, **({} if faults else {"NO_FAULTS": "1"})})
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-3000:]
        finals.append([x for x in out.splitlines() if x.startswith("weights ")])
        if faults:
            assert "inplace_recovered" in out, out[-3000:]
            assert out.count("restored step 4 from local memory") == 2, out[-3000:]
    assert len(finals[0]) == 1 and finals[0] == finals[1], finals


# -- the entry itself, in one process (no group: plain tensors are their own full state) ----------

def plain_build(seed: int, built: list[int]):
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        built.append(seed)
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        return model, torch.optim.Adam(model.parameters(), lr=0.01)
    return build


def trained(entry: Rebuilt, steps: int) -> None:
    for s in range(steps):
        entry.optimizer.zero_grad()
        entry.model(torch.full((2, 3), float(s))).pow(2).sum().backward()
        entry.optimizer.step()


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), other=st.integers(0, 2**16), steps=st.integers(0, 3))
def test_the_state_moves_into_a_model_built_from_another_seed(seed: int, other: int, steps: int) -> None:
    built: list[int] = []
    first = Rebuilt(plain_build(seed, built))
    trained(first, steps)
    saved = copy.deepcopy(first.state_dict())   # as State's commit does: it aliases live tensors
    second = Rebuilt(plain_build(other, built))
    second.load_state_dict(saved)
    assert built == [seed]                       # loading builds nothing: no group may exist yet
    assert same(second.state_dict(), saved) and built == [seed, other]
    trained(first, 1)
    trained(second, 1)                           # and both go on alike
    assert same(second.state_dict(), first.state_dict())


def test_loading_drops_the_stale_module_and_the_next_use_rebuilds() -> None:
    built: list[int] = []
    entry = Rebuilt(plain_build(1, built))
    stale = entry.model
    entry.load_state_dict(entry.state_dict())
    assert entry.model is not stale and built == [1, 1]


@pytest.mark.parametrize("bad", [{"model": {}}, {"weight": torch.zeros(1)}, [1, 2]])
def test_a_state_of_another_shape_is_refused_in_one_line(bad: object) -> None:
    with pytest.raises(ValueError) as e:
        Rebuilt(plain_build(0, [])).load_state_dict(bad)  # type: ignore[arg-type]
    assert "\n" not in str(e.value) and "Rebuilt.state_dict()" in str(e.value)

"""The Python API's mistakes are named where they are made: ``ElasticSampler``'s arguments,
``State``'s entries, ``fault_point``'s step, a forgotten ``state.restore()``, and a worker's
exception named in the failure summary instead of "exit code 1"."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import IterableDataset, TensorDataset

from elastictk.agent.policy import Failure, GiveUp, RestartPolicy
from elastictk.data import DataLoader, ElasticSampler
from elastictk.faults import fault_point
from elastictk.inplace import state as state_mod
from elastictk.inplace.state import State, StateError
from elastictk.supervisor.report import ProcessFailure, exception_in

TIER_ENV = ("ELASTICTK_SNAPSHOT", "ELASTICTK_SNAPSHOT_DIR", "ELASTICTK_SNAPSHOT_EVERY",
            "ELASTICTK_SNAPSHOT_OVERLAP")


@pytest.fixture(autouse=True)
def _no_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TIER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------- ElasticSampler
class _Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Iterator[int]:
        yield 1


DS = TensorDataset(torch.arange(10))


@pytest.mark.parametrize("kwargs, match", [
    ({"dataset": None}, "map-style dataset with len\\(\\), got None"),
    ({"dataset": _Stream()}, "IterableDataset has no indices"),
    ({"dataset": DS, "seed": "a"}, "seed='a'\\): an int"),
    ({"dataset": DS, "seed": True}, "seed=True\\): an int, not a bool"),
    ({"dataset": DS, "shuffle": "no"}, "shuffle='no'\\): True or False"),
    ({"dataset": DS, "drop_last": "yes"}, "drop_last='yes'\\): True or False"),
    ({"dataset": DS, "num_replicas": "2"}, "num_replicas='2'\\): an int"),
])
def test_elastic_sampler_names_a_wrong_argument(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        ElasticSampler(**kwargs)


def test_numpy_ints_and_0_1_flags_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    s = ElasticSampler(DS, num_replicas=np.int64(2), rank=np.int32(1), seed=np.int64(3), shuffle=0)
    assert (s.num_replicas, s.rank, s.seed, s.shuffle) == (2, 1, 3, False)


@pytest.mark.parametrize("workers", [0, 1])
def test_torchs_own_dataloader_takes_an_elastic_sampler_as_it_takes_distributed_sampler(
        workers: int) -> None:
    """``DataLoader(ds, batch_size=B, sampler=ElasticSampler(ds))``, torch's loader: the batch
    size comes from torch's batch sampler (it used to fail in every rank at the first batch),
    and the batches are the ones elastictk.data.DataLoader gives."""
    ours = ElasticSampler(DS, num_replicas=2, rank=1, seed=5)
    theirs = ElasticSampler(DS, num_replicas=2, rank=1, seed=5)
    torch_loader = TorchLoader(DS, batch_size=2, sampler=theirs, num_workers=workers)
    assert len(torch_loader) == len(DataLoader(DS, batch_size=2, sampler=ours))
    got = [b[0].tolist() for b in torch_loader]
    want = [b[0].tolist() for b in DataLoader(DS, batch_size=2, sampler=ours)]
    assert got == want and theirs.batch_size == 2
    assert theirs.position == ours.position == len(DS)


def test_a_sampler_iterated_bare_still_needs_a_batch_size() -> None:
    with pytest.raises(ValueError, match="needs batch_size=.*DataLoader\\(batch_size=...\\)"):
        list(ElasticSampler(DS, num_replicas=1, rank=0))


# ---------------------------------------------------------------- State
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(2, 1)


@pytest.mark.parametrize("name", ["optimizer", "model", "sampler", "lr_scheduler"])
def test_a_string_where_an_object_belongs_is_refused(name: str) -> None:
    with pytest.raises(StateError, match=f"State\\({name}='adam'\\): '{name}' is a str, not an object"):
        State(**{name: "adam"}, step=0)


def test_an_optimizer_over_another_models_parameters_is_refused() -> None:
    model, other = _model(), _model()
    with pytest.raises(StateError, match="updates none of the parameters of the registered module"):
        State(model=model, optimizer=torch.optim.SGD(other.parameters(), lr=0.1), step=0)
    State(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), step=0)
    wrapped = torch.nn.Sequential(model)  # a wrapper shares its module's parameters
    State(model=wrapped, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), step=0)


def test_a_misspelt_entry_gets_a_did_you_mean() -> None:
    state = State(step=0, epoch=1)
    with pytest.raises(AttributeError, match="'stpe' \\(did you mean 'step'\\?\\)"):
        _ = state.stpe
    with pytest.raises(StateError, match="'stpe' \\(did you mean 'step'\\?\\)"):
        state.stpe = 1
    with pytest.raises(AttributeError) as info:
        _ = state.zzz
    assert "did you mean" not in str(info.value)


def test_an_entry_a_snapshot_cannot_serialize_is_named(tmp_path: Path) -> None:
    state = State(snapshot_dir=str(tmp_path / "snaps"), step=0, schedule=lambda s: s * 2)
    with pytest.raises(StateError, match="State entry 'schedule' \\(function\\) cannot be saved"):
        state.commit()
    state_mod.State(snapshot_dir=str(tmp_path / "ok"), step=0).commit()  # plain data commits


def test_a_restarted_worker_committing_without_restore_is_told_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="elastictk.inplace")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "without state.restore()" in r.getMessage()]

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    forgot = State(snapshot_dir=str(tmp_path / "a"), step=0)
    forgot.commit()
    forgot.commit()
    (line,) = lines()
    assert "restart 1" in line and "call state.restore()" in line and "\n" not in line

    caplog.clear()
    restored = State(snapshot_dir=str(tmp_path / "b"), step=0)
    restored.restore()
    restored.commit()
    assert lines() == []

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a first start has nothing to restore
    State(snapshot_dir=str(tmp_path / "c"), step=0).commit()
    assert lines() == []


# ---------------------------------------------------------------- fault_point
@pytest.mark.parametrize("step", ["x", 1.5, None, True])
def test_fault_point_names_a_step_that_is_not_an_int(step: Any) -> None:
    with pytest.raises(TypeError, match="fault_point\\(step=.*\\): the step number, an int"):
        fault_point(step)


# ---------------------------------------------------------------- the exception, named
def test_the_exception_is_read_from_a_traceback_or_a_compile_error() -> None:
    assert exception_in(["Traceback (most recent call last):", '  File "t.py", line 3, in <module>',
                         "    import foo", "ModuleNotFoundError: No module named 'foo'",
                         "[W1128 gloo] a warning after it"]) == "ModuleNotFoundError: No module named 'foo'"
    assert exception_in(['  File "/t/x.py", line 1', "    def (", "        ^",
                         "SyntaxError: invalid syntax"]) == "SyntaxError: invalid syntax"
    assert exception_in(["step 1", "loss 0.3"]) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=400), max_size=60))
def test_any_stderr_tail_gives_a_short_line_or_nothing(tail: list[str]) -> None:
    got = exception_in(tail)
    assert got is None or (isinstance(got, str) and 0 < len(got) <= 300)


def test_the_cause_names_the_exception_from_the_tail_when_no_error_file_was_written() -> None:
    failure = ProcessFailure(rank=0, local_rank=0, pid=1, hostname="h", exitcode=1, signal=None,
                             started_at=0.0, ended_at=1.0,
                             stderr_tail=("Traceback (most recent call last):", "  File ...",
                                          "ImportError: cannot import name 'x'"))
    assert failure.cause() == "rank 0's ImportError: cannot import name 'x' (exit code 1)"
    killed = ProcessFailure(rank=0, local_rank=0, pid=1, hostname="h", exitcode=-9, signal=9,
                            started_at=0.0, ended_at=1.0, stderr_tail=failure.stderr_tail)
    assert killed.cause() == "rank 0's SIGKILL (signal 9)"


@pytest.mark.parametrize("source, recorded, want", [
    ("def (\n", False, "SyntaxError: invalid syntax"),
    ("import no_such_module_elastictk\n", False, "ModuleNotFoundError: No module named"),
    ("import elastictk\n@elastictk.record\ndef main():\n    raise ValueError('mine')\nmain()\n",
     True, "ValueError: mine"),
])
def test_a_forked_script_worker_records_the_exception_that_ended_it(
        tmp_path: Path, source: str, recorded: bool, want: str) -> None:
    """The fork server's script runner writes the error file for an exception the script did
    not record itself (and keeps one @elastictk.record wrote), so the summary names it."""
    script = tmp_path / "w.py"
    script.write_text(source)
    error_file = tmp_path / "error.json"
    runner = textwrap.dedent(f"""
        import sys
        from elastictk.supervisor.child import run_python
        sys.exit(run_python("script", {str(script)!r}, []))
    """)
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}
    done = subprocess.run([sys.executable, "-c", runner], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    message = json.loads(error_file.read_text())["message"]
    text = message if isinstance(message, str) else json.dumps(message)
    assert want in text


def test_a_budget_spent_on_start_up_failures_says_so_and_names_the_way_out() -> None:
    policy = RestartPolicy(max_restarts=2)
    cause = "rank 0's SyntaxError: invalid syntax"
    _, out = policy.run([Failure(float(t), cause, progressed=False) for t in range(3)])
    assert isinstance(out[-1], GiveUp)
    assert cause in out[-1].reason and "all failed before any rank's first step" in out[-1].reason
    assert "--max-no-progress-restarts 1" in out[-1].reason
    _, out = policy.run([Failure(0.0, cause, False), Failure(1.0, cause, True), Failure(2.0, cause, True)])
    assert isinstance(out[-1], GiveUp) and "before any rank's first step" not in out[-1].reason

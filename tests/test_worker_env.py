"""Pure parts of the worker group: torchrun's environment, rank assignment, spec parsing."""
from __future__ import annotations

import signal
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.supervisor.env import Assignment, AssignmentError, assign_ranks, worker_env
from elastictk.supervisor.spec import (
    SpecError, Std, WorkerResult, WorkerSpec, parse_python_argv, python_module_argv,
    python_script_argv, signal_name, std_for,
)

TORCHRUN_VARS = {
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE",
}

nodes_st = st.lists(
    st.tuples(st.sampled_from(["trainer", "ps", "eval"]), st.integers(1, 8)), min_size=1, max_size=12)


def _envs(nodes: list[tuple[str, int]], base: dict[str, str] | None = None) -> list[dict[str, str]]:
    out = []
    for group_rank, (ranks, (role, lws)) in enumerate(zip(assign_ranks(nodes), nodes)):
        a = Assignment.from_node_ranks(group_rank, len(nodes), ranks, master_addr="10.0.0.1",
                                       master_port=29500, run_id="job", restart_count=2,
                                       max_restarts=5)
        a.check(lws)
        for lr in range(lws):
            out.append(worker_env(a, role=role, local_rank=lr, local_world_size=lws,
                                  error_file=f"/logs/{group_rank}/{lr}/error.json",
                                  base_env=base or {}))
    return out


@settings(max_examples=200, deadline=None)
@given(nodes_st)
def test_global_ranks_are_unique_and_contiguous_across_nodes(nodes: list[tuple[str, int]]) -> None:
    envs = _envs(nodes)
    world = sum(size for _, size in nodes)
    assert sorted(int(e["RANK"]) for e in envs) == list(range(world))
    assert {e["WORLD_SIZE"] for e in envs} == {str(world)}
    assert {e["GROUP_WORLD_SIZE"] for e in envs} == {str(len(nodes))}
    # each node holds one contiguous block, following local ranks, blocks in group-rank order
    next_base = 0
    for group_rank, (_, lws) in enumerate(nodes):
        mine = [e for e in envs if e["GROUP_RANK"] == str(group_rank)]
        assert [int(e["RANK"]) for e in mine] == [next_base + int(e["LOCAL_RANK"]) for e in mine]
        assert sorted(int(e["LOCAL_RANK"]) for e in mine) == list(range(lws))
        next_base += lws


@settings(max_examples=200, deadline=None)
@given(nodes_st)
def test_role_ranks_are_unique_and_contiguous_per_role(nodes: list[tuple[str, int]]) -> None:
    envs = _envs(nodes)
    for role in {r for r, _ in nodes}:
        mine = [e for e in envs if e["ROLE_NAME"] == role]
        size = sum(s for r, s in nodes if r == role)
        assert sorted(int(e["ROLE_RANK"]) for e in mine) == list(range(size))
        assert {e["ROLE_WORLD_SIZE"] for e in mine} == {str(size)}


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 16), st.integers(1, 8), st.data())
def test_homogeneous_matches_the_general_assignment(gws: int, lws: int, data: st.DataObject) -> None:
    group_rank = data.draw(st.integers(0, gws - 1))
    fast = Assignment.homogeneous(group_rank, gws, lws, master_addr="h", master_port=1, run_id="r")
    slow = Assignment.from_node_ranks(group_rank, gws, assign_ranks([("default", lws)] * gws)[group_rank],
                                      master_addr="h", master_port=1, run_id="r")
    for lr in range(lws):
        kw = dict(role="default", local_rank=lr, local_world_size=lws, error_file=None, base_env={})
        assert worker_env(fast, **kw) == worker_env(slow, **kw)  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text("ABCDEFGHIJ_", min_size=1, max_size=8), st.text(max_size=5), max_size=6),
       st.integers(1, 4))
def test_torchrun_variables_win_over_inherited_ones_and_the_rest_passes_through(
        base: dict[str, str], lws: int) -> None:
    polluted = dict(base, RANK="99", WORLD_SIZE="99", CUDA_VISIBLE_DEVICES="3,1")
    a = Assignment.homogeneous(0, 1, lws, master_addr="127.0.0.1", master_port=29400, run_id="r")
    env = worker_env(a, role="default", local_rank=0, local_world_size=lws, error_file="/e.json",
                     base_env=polluted)
    assert TORCHRUN_VARS <= set(env)
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == str(lws)
    assert env["CUDA_VISIBLE_DEVICES"] == "3,1"
    for k, v in base.items():
        if k not in TORCHRUN_VARS and k not in ("OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
            assert env[k] == v


def test_values_and_spelling_match_torchrun() -> None:
    a = Assignment(group_rank=1, group_world_size=3, base_global_rank=4, global_world_size=12,
                   master_addr="node0", master_port=29500, run_id="job7", restart_count=2,
                   max_restarts=3, use_agent_store=True)
    env = worker_env(a, role="trainer", local_rank=2, local_world_size=4,
                     error_file="/l/job7/attempt_2/2/error.json", base_env={})
    assert {k: env[k] for k in TORCHRUN_VARS} == {
        "RANK": "6", "LOCAL_RANK": "2", "GROUP_RANK": "1", "ROLE_RANK": "6", "ROLE_NAME": "trainer",
        "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "12", "GROUP_WORLD_SIZE": "3", "ROLE_WORLD_SIZE": "12",
        "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "job7",
        "TORCHELASTIC_ERROR_FILE": "/l/job7/attempt_2/2/error.json",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def test_omp_threads_defaults_to_one_only_with_several_workers_and_never_overrides() -> None:
    a = Assignment.homogeneous(0, 1, 2, master_addr="h", master_port=1, run_id="r")
    kw = dict(role="default", local_rank=0, error_file=None)
    assert worker_env(a, local_world_size=2, base_env={}, **kw)["OMP_NUM_THREADS"] == "1"  # type: ignore[arg-type]
    assert "OMP_NUM_THREADS" not in worker_env(a, local_world_size=1, base_env={}, **kw)  # type: ignore[arg-type]
    assert worker_env(a, local_world_size=2, base_env={"OMP_NUM_THREADS": "8"}, **kw)["OMP_NUM_THREADS"] == "8"  # type: ignore[arg-type]
    assert worker_env(a, local_world_size=2, base_env={}, extra={"OMP_NUM_THREADS": "4"}, **kw)["OMP_NUM_THREADS"] == "4"  # type: ignore[arg-type]
    assert worker_env(a, local_world_size=2, base_env={}, **kw)["TORCHELASTIC_ERROR_FILE"] == ""  # type: ignore[arg-type]


@pytest.mark.parametrize("kw, field", [
    (dict(group_rank=3, group_world_size=3), "group_rank"),
    (dict(base_global_rank=3, global_world_size=4), "do not fit"),
    (dict(master_port=0), "master_port"),
    (dict(master_addr=""), "master_addr"),
    (dict(run_id=""), "run_id"),
])
def test_impossible_assignments_fail_with_one_line_naming_the_field(kw: dict, field: str) -> None:
    base = dict(group_rank=0, group_world_size=1, base_global_rank=0, global_world_size=2,
                master_addr="h", master_port=29500, run_id="r")
    with pytest.raises(AssignmentError, match=field) as e:
        Assignment(**{**base, **kw}).check(2)
    assert "\n" not in str(e.value)


def test_std_parses_torchrun_syntax() -> None:
    assert Std.parse("3") is Std.ALL
    assert Std.parse("0:3,1:0,2:1") == {0: Std.ALL, 1: Std.NONE, 2: Std.OUT}
    assert std_for({1: Std.ERR}, 0) is Std.NONE and std_for(Std.OUT, 5) is Std.OUT
    with pytest.raises(SpecError, match="0-3"):
        Std.parse("4")


def test_python_argv_recognition() -> None:
    t = parse_python_argv(python_script_argv("train.py", "--lr", "1"))
    assert t is not None and (t.kind, t.target, t.args) == ("script", "train.py", ("--lr", "1"))
    m = parse_python_argv(python_module_argv("pkg.train", "-x"))
    assert m is not None and (m.kind, m.target, m.args) == ("module", "pkg.train", ("-x",))
    assert parse_python_argv(["/usr/bin/env", "true"]) is None
    assert parse_python_argv([sys.executable, "-O", "x.py"]) is None


def test_spec_validation_names_the_problem() -> None:
    with pytest.raises(SpecError, match="argv list"):
        WorkerSpec("train.py")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="cannot run a callable"):
        WorkerSpec(print, start_method="subprocess")
    with pytest.raises(SpecError, match="cannot run an argv"):
        WorkerSpec(["/bin/true"], start_method="spawn")
    with pytest.raises(SpecError, match="subprocess"):
        WorkerSpec(["/bin/true"], start_method="preload")
    with pytest.raises(SpecError, match="local_world_size"):
        WorkerSpec(["/bin/true"], local_world_size=0)
    spec = WorkerSpec(["/bin/echo"], args=("--rank=${local_rank}",), redirects="0:3,1:1")  # type: ignore[arg-type]
    assert spec.start_method == "subprocess" and spec.argv(1) == ["/bin/echo", "--rank=1"]
    assert spec.redirects == {0: Std.ALL, 1: Std.OUT}
    assert WorkerSpec(print).start_method == "spawn"


@given(st.integers(-64, 255))
def test_signal_names(code: int) -> None:
    name = signal_name(code)
    if code >= 0:
        assert name is None
    else:
        assert name is not None and name.startswith("SIG")
    assert signal_name(-signal.SIGSEGV) == "SIGSEGV" and signal_name(None) is None


def test_result_reads_like_a_signal_not_a_negative_number() -> None:
    r = WorkerResult(local_rank=1, rank=5, role_rank=5, role="default", attempt=0, pid=42,
                     exitcode=-11, started_at=1.0, ended_at=2.0)
    assert (r.signal, r.signal_name, r.failed) == (11, "SIGSEGV", True)
    assert r.describe() == "rank 5 (local 1, pid 42): SIGSEGV"

"""elastictk-run's flags: the same meaning as torchrun's, PET_* defaults, one-line errors.

The reference is torch's own parser: each sample argv goes through
``torch.distributed.run.get_args_parser()`` + ``config_from_args()`` and through
``elastictk.cli.parse_args``, and every setting both have must agree.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import Std as TorchStd
from torch.distributed.elastic.multiprocessing.api import to_map
from torch.distributed.elastic.rendezvous.api import RendezvousParameters
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from elastictk.cli import LaunchConfig, Std, UsageError, parse_args, validate
from elastictk.cli.args import main_for_test
from elastictk.cli.values import parse_filters, parse_nnodes, parse_rdzv_conf, parse_std
from elastictk.store.endpoint import Endpoint, quiet_port

SCRIPT = "train.py"
_ENV_PREFIXES = ("PET_", "ELASTICTK_")
_ENV_NAMES = ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PYTHON_EXEC",
              "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cwd holding train.py, a clean launcher environment, and torch's side effects contained.

    torch's ``config_from_args`` creates a temp log dir when none is given and sets
    OMP_NUM_THREADS in this process; both are kept inside the test.
    """
    monkeypatch.chdir(tmp_path)
    (tmp_path / SCRIPT).write_text("print('hello')\n")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in list(os.environ):
        if name.startswith(_ENV_PREFIXES) or name in _ENV_NAMES:
            monkeypatch.delenv(name)
    return tmp_path


def torch_reference(argv: list[str]) -> tuple[Any, Any, Any, list[str]]:
    """What torchrun would launch for ``argv``: (namespace, LaunchConfig, cmd, cmd_args)."""
    args = torchrun.get_args_parser().parse_args(argv)
    # torchrun's run() rewrites these before config_from_args and then launches, so the rewrite
    # is mirrored here; test_reference_mirrors_torchrun_run guards against drift.
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
        if max_nodes == 1:
            args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, cmd, cmd_args = torchrun.config_from_args(args)
    return args, config, cmd, cmd_args


def test_reference_mirrors_torchrun_run() -> None:
    source = inspect.getsource(torchrun.run)
    for line in ('args.rdzv_endpoint = "localhost:0"', "if max_nodes == 1:",
                 "args.master_port = 29500", "config_from_args(args)"):
        assert line in source


def assert_same_as_torch(argv: list[str], ours: LaunchConfig) -> None:
    args, ref, cmd, cmd_args = torch_reference(argv)
    assert (ours.min_nodes, ours.max_nodes) == (ref.min_nodes, ref.max_nodes)
    assert ours.nproc_per_node == ref.nproc_per_node
    assert ours.rdzv_backend == {"etcd-v2": "etcd"}.get(ref.rdzv_backend, ref.rdzv_backend)
    default_port = {"c10d": 29400, "etcd": 2379, "static": -1}[ours.rdzv_backend]
    assert ours.rdzv_endpoint == Endpoint(*parse_rendezvous_endpoint(ref.rdzv_endpoint,
                                                                     default_port))
    if ours.standalone:
        uuid.UUID(ours.run_id), uuid.UUID(ref.run_id)
    else:
        assert ours.run_id == ref.run_id
    params = RendezvousParameters("x", "x", "x", 1, 1, **ref.rdzv_configs)
    for key, value in ours.rdzv_conf.items():
        got = params.get_as_bool(key) if isinstance(value, bool) else float(params.get(key))
        assert value == got, key
    assert set(ref.rdzv_configs) - set(ours.rdzv_conf) <= {"timeout", "rank"}
    if ours.rdzv_backend == "static":
        assert ref.rdzv_configs["rank"] == ours.node_rank
    assert ours.max_restarts == ref.max_restarts
    assert ours.monitor_interval == ref.monitor_interval
    assert ours.start_method == ref.start_method
    assert ours.role == ref.role
    if ours.run_path:
        assert cmd is torchrun.run_script_path and ours.entrypoint[2:] == cmd_args
    else:
        assert ours.entrypoint == [cmd, *cmd_args]
    assert (ours.module, ours.no_python, ours.run_path) == (args.module, args.no_python,
                                                            args.run_path)
    assert ours.training_script == args.training_script
    assert ours.training_script_args == args.training_script_args
    assert ours.log_dir == args.log_dir
    for mine, theirs in ((ours.redirects, args.redirects), (ours.tee, args.tee)):
        expected = to_map(TorchStd.from_str(theirs), ours.nproc_per_node)
        assert {r: int(s) for r, s in mine.items()} == {r: int(s) for r, s in expected.items()}
    assert (set(ours.local_ranks_filter) if ours.local_ranks_filter else None) == \
        ref.logs_specs._local_ranks_filter
    assert ours.node_rank == args.node_rank
    assert ours.master_addr == args.master_addr.strip("[]")
    assert ours.master_port == args.master_port
    assert ours.local_addr == ref.local_addr
    assert list(ours.signals_to_handle) == [
        getattr(signal, s.strip()) for s in ref.signals_to_handle.split(",")
    ]
    assert ours.virtual_local_rank == ref.virtual_local_rank
    assert ours.grace_period == ref.shutdown_timeout
    # torch keeps an empty item ('' is in every line: all lines duplicated); elastictk drops
    # it, as torch's help promises ("an empty filters list won't duplicate any lines").
    for mine, theirs in ((ours.duplicate_stdout_filters, ref.duplicate_stdout_filters),
                         (ours.duplicate_stderr_filters, ref.duplicate_stderr_filters)):
        assert mine == tuple(f for f in theirs or () if f)


@pytest.mark.parametrize("change", [
    {"max_nodes": 2}, {"nproc_per_node": 2}, {"rdzv_endpoint": Endpoint("localhost", 1)},
    {"entrypoint": ["python", SCRIPT]}, {"redirects": {0: Std.ALL}}, {"grace_period": 5.0},
    {"signals_to_handle": (signal.SIGTERM,)}, {"start_method": "fork"},
    {"duplicate_stdout_filters": ("a",)}, {"duplicate_stderr_filters": ("a",)},
])
def test_the_torch_comparison_notices_a_difference(workdir: Path, change: dict[str, Any]) -> None:
    ours = dataclasses.replace(parse_args([SCRIPT]), **change)
    with pytest.raises(AssertionError):
        assert_same_as_torch([SCRIPT], ours)


# Samples of torchrun command lines; "{free}" becomes a free port, "{tmp}" the test's directory.
SAMPLES: list[list[str]] = [
    [SCRIPT],
    [SCRIPT, "--lr", "0.1", "--nnodes", "5", "-m", "x"],
    ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:1234",
     "--rdzv-id", "job1", SCRIPT],
    ["--nnodes=1:4", "--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_endpoint=node0",
     "--rdzv_id", "abc", SCRIPT, "a", "b"],
    ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "[::1]:29411", SCRIPT],
    ["--standalone", "--nproc-per-node", "3", SCRIPT],
    ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.1.1", "--master-port", "1234",
     SCRIPT],
    ["--nnodes", "2", "--node_rank", "1", "--master_addr", "[::1]", "--master_port", "1234",
     SCRIPT],
    ["--master-port", "{free}", SCRIPT],
    ["--max-restarts", "3", "--monitor-interval", "0.5", "--start-method", "fork", "--role",
     "trainer", SCRIPT],
    ["--max_restarts=2", "--monitor_interval=1", "--start_method=forkserver", SCRIPT],
    ["-m", "pkg.train", "--epochs", "3"],
    ["--module", "pkg.train"],
    ["--no-python", "echo", "hi"],
    ["--no_python", "echo"],
    ["--run-path", SCRIPT, "x"],
    ["--log-dir", "{tmp}/logs", "-r", "3", "-t", "0:1,1:2", "--nproc-per-node", "2", SCRIPT],
    ["--log_dir={tmp}/logs", "--redirects", "0:2", "--tee=1", SCRIPT],
    ["--local-ranks-filter", "0,1", "--nproc-per-node", "2", SCRIPT],
    ["--local_ranks_filter=1", "--nproc-per-node", "2", SCRIPT],
    ["--local-addr", "127.0.0.1", SCRIPT],
    ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:{free}",
     "--rdzv-conf", "join_timeout=5,last_call_timeout=1,is_host=true,read_timeout=7", SCRIPT],
    ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1",
     "--rdzv_conf", "close_timeout=3, timeout=100 ,heartbeat_timeout=9", SCRIPT],
    ["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "etcd-host", "--nnodes", "2", SCRIPT],
    ["--rdzv-backend", "etcd", "--nnodes", "2", SCRIPT],
    ["--shutdown-timeout", "7", "--signals-to-handle", "SIGTERM,SIGUSR1", SCRIPT],
    ["--shutdown_timeout=0", "--signals_to_handle=SIGINT", SCRIPT],
    ["--virtual-local-rank", SCRIPT],
    ["--nproc-per-node", "cpu", SCRIPT],
    ["--nproc-per-node", "auto", SCRIPT],
    ["--event-log-handler", "null", SCRIPT],
    ["--nnodes", "1", "--rdzv-id", "ignored", SCRIPT],
    ["--tee", "3", "--duplicate-stdout-filters", "apple,or,,ange", SCRIPT],
    ["-t", "2", "--duplicate_stderr_filters=,,x,,,y,", "--duplicate-stdout-filters", "", SCRIPT],
]


def _fill(argv: list[str], tmp: Path) -> list[str]:
    port = str(quiet_port())
    return [a.replace("{free}", port).replace("{tmp}", str(tmp)) for a in argv]


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda a: " ".join(a)[:60])
def test_same_settings_as_torchrun(workdir: Path, sample: list[str]) -> None:
    argv = _fill(sample, workdir)
    assert_same_as_torch(argv, parse_args(argv))


@pytest.mark.parametrize(
    "env",
    [
        {"PET_NNODES": "2", "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "10.0.0.5:1234",
         "PET_RDZV_ID": "envjob", "PET_NPROC_PER_NODE": "2", "PET_MAX_RESTARTS": "4",
         "PET_MONITOR_INTERVAL": "0.25", "PET_START_METHOD": "fork", "PET_ROLE": "r",
         "PET_TEE": "3", "PET_REDIRECTS": "0:2", "PET_LOCAL_RANKS_FILTER": "1",
         "PET_RDZV_CONF": "join_timeout=9"},
        {"PET_STANDALONE": "1"},
        {"PET_STANDALONE": "0"},
        {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "10.0.0.9",
         "PET_MASTER_PORT": "29600"},
        {"PET_SHUTDOWN_TIMEOUT": "9", "PET_SIGNALS_TO_HANDLE": "SIGTERM"},
        {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "12"},
        {"PET_VIRTUAL_LOCAL_RANK": "1", "PET_LOCAL_ADDR": "127.0.0.1"},
        {"PET_RUN_PATH": "1"},
        {"PYTHON_EXEC": "/opt/python3"},
        {"PET_TEE": "3", "PET_DUPLICATE_STDOUT_FILTERS": "a,,b,c",
         "PET_DUPLICATE_STDERR_FILTERS": "err"},
    ],
    ids=lambda e: ",".join(e),
)
def test_pet_environment_defaults_match_torchrun(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = [SCRIPT, "--x"]
    assert_same_as_torch(argv, parse_args(argv))


@pytest.mark.parametrize("env,argv", [
    ({"PET_MODULE": "1"}, ["pkg.mod"]),
    ({"PET_NO_PYTHON": "1"}, ["echo", "hi"]),
])
def test_pet_switches_match_torchrun(workdir: Path, monkeypatch: pytest.MonkeyPatch,
                                     env: dict[str, str], argv: list[str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert_same_as_torch(argv, parse_args(argv))


def test_command_line_beats_environment(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NNODES", "not-a-number")
    monkeypatch.setenv("PET_MAX_RESTARTS", "7")
    argv = ["--nnodes", "1", "--max-restarts", "2", SCRIPT]
    config = parse_args(argv)
    assert config.max_restarts == 2
    assert_same_as_torch(argv, config)


_PAIRS = [
    ("--nproc-per-node", "--nproc_per_node", "2"),
    ("--rdzv-conf", "--rdzv_conf", "join_timeout=3"),
    ("--max-restarts", "--max_restarts", "5"),
    ("--monitor-interval", "--monitor_interval", "2.5"),
    ("--start-method", "--start_method", "forkserver"),
    ("--log-dir", "--log_dir", "logs"),
    ("--local-ranks-filter", "--local_ranks_filter", "0"),
    ("--node-rank", "--node_rank", "0"),
    ("--master-addr", "--master_addr", "127.0.0.1"),
    ("--local-addr", "--local_addr", "10.0.0.1"),
    ("--signals-to-handle", "--signals_to_handle", "SIGTERM,SIGHUP"),
    ("--shutdown-timeout", "--shutdown_timeout", "4"),
    ("-r", "--redirects", "2"),
    ("-t", "--tee", "0:3"),
]


def _comparable(config: LaunchConfig) -> dict[str, Any]:
    data = dataclasses.asdict(config)
    data.pop("run_id")  # random under --standalone and the single-node default
    return data


@pytest.mark.parametrize("one,other,value", _PAIRS, ids=lambda x: str(x))
def test_hyphen_underscore_and_equals_spellings_agree(workdir: Path, one: str, other: str,
                                                      value: str) -> None:
    forms = [[one, value], [other, value]]
    if one.startswith("--"):
        forms += [[f"{one}={value}"], [f"{other}={value}"]]
    configs = [_comparable(parse_args([*form, SCRIPT])) for form in forms]
    assert all(c == configs[0] for c in configs)


@pytest.mark.parametrize("one,other", [
    ("--rdzv-backend", "--rdzv_backend"), ("--rdzv-endpoint", "--rdzv_endpoint"),
    ("--rdzv-id", "--rdzv_id"),
])
def test_rdzv_spellings_agree(workdir: Path, one: str, other: str) -> None:
    base = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:9", "--rdzv-id", "j"]
    flag_at = base.index(one)
    swapped = base[:flag_at] + [other] + base[flag_at + 1:]
    assert parse_args([*base, SCRIPT]) == parse_args([*swapped, SCRIPT])


BAD: list[tuple[list[str], str]] = [
    (["--nnodes", "3:2", SCRIPT],
     "--nnodes 3:2: min 3 > max 2: use --nnodes MIN:MAX with MIN <= MAX"),
    (["--nnodes", "abc", SCRIPT], "'abc' is not a number of nodes"),
    (["--nnodes", "0", SCRIPT], "at least 1"),
    (["--nnodes", "1:2:3", SCRIPT], "too many ':'"),
    (["--nproc-per-node", "0", SCRIPT], "at least 1 worker"),
    (["--nproc-per-node", "xpu", SCRIPT], "XPU is not available"),
    (["--nproc-per-node", "tpu9", SCRIPT], "unknown device 'tpu9'"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "host:port", SCRIPT],
     "--rdzv-endpoint host:port: invalid endpoint"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "tcp://h:1", SCRIPT],
     "leave out the scheme"),
    (["--rdzv-backend", "zookeeper", SCRIPT], "unknown rendezvous backend; use one of c10d"),
    (["--rdzv-conf", "join_timeout", SCRIPT], "is not key=value"),
    (["--rdzv-conf", "bogus=1", SCRIPT], "unknown key 'bogus'; known keys: join_timeout"),
    (["--rdzv-conf", "join_timeout=soon", SCRIPT], "not a number of seconds"),
    (["--rdzv-conf", "is_host=maybe", SCRIPT], "not a boolean"),
    (["--rdzv-conf", "heartbeat_interval=5,heartbeat_timeout=2", SCRIPT], "must exceed"),
    (["--rdzv-conf", "timeout=1,timeout=2", SCRIPT], "given twice"),
    (["missing.py"], "training script 'missing.py' not found"),
    (["--no-python", "no-such-program-etk"], "not found on PATH"),
    (["--max-restarts", "-1", SCRIPT], "--max-restarts -1: must be at least 0"),
    (["--max-restarts", "two", SCRIPT], "not a whole number"),
    (["--monitor-interval", "0", SCRIPT], "more than 0"),
    (["--start-method", "thread", SCRIPT], "use one of spawn, fork, forkserver, preload"),
    (["-m", "--no-python", SCRIPT], "cannot be used together"),
    (["--standalone", "--nnodes", "2", SCRIPT], "--standalone runs one node"),
    (["--nnodes", "2", "--node-rank", "2", "--master-port", "29501", SCRIPT],
     "needs --node-rank in 0..1"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:0", SCRIPT], "port 0"),
    (["--rdzv-backend", "file", SCRIPT], "needs --rdzv-endpoint PATH"),
    (["--rdzv-backend", "file", "--rdzv-endpoint", "/no/such/dir/rdzv", SCRIPT],
     "does not exist"),
    (["-r", "4", SCRIPT], "use 0 (none), 1 (stdout)"),
    (["-t", "0:1,0:2", SCRIPT], "given twice"),
    (["--local-ranks-filter", "0,x", SCRIPT], "'x' is not a local rank"),
    (["--signals-to-handle", "SIGKILL", SCRIPT], "cannot be caught"),
    (["--signals-to-handle", "SIGNOPE", SCRIPT], "not a signal name"),
    (["--master-addr", "host:1234", SCRIPT], "without a port"),
    (["--logs-specs", "x", SCRIPT], "--logs-specs x: no entry point of that name in group "
                                    "'torchrun.logs_specs' (installed: "),
    (["--event-log-handler", "nosuch", SCRIPT], "no torch event handler of that name"),
    (["--recovery", "retry", SCRIPT], "use one of restart-all, in-place"),
    (["--restart-intensity", "3", SCRIPT], "write R/T"),
    (["--restart-intensity", "3/0", SCRIPT], "more than 0"),
    (["--metrics-port", "70000", SCRIPT], "out of range"),
    (["--grace-period", "5", "--shutdown-timeout", "6", SCRIPT], "disagree"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-id", "a/b", SCRIPT], "no '/'"),
    (["--collective-timeout", "-1", SCRIPT], "more than 0"),
    (["--role", " ", SCRIPT], "--role is empty"),
    ([], "no training script given"),
    (["--bogus-flag", SCRIPT], "unrecognized arguments: --bogus-flag"),
]


@pytest.mark.parametrize("argv,needle", BAD,
                         ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_bad_input_is_one_line_and_exit_2(workdir: Path, argv: list[str], needle: str) -> None:
    code, err, config = main_for_test(argv)
    assert (code, config) == (2, None)
    assert err.startswith("elastictk-run: error: ") and err.endswith("\n")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert needle in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
@pytest.mark.parametrize("mode", ["node", "socket", "exclusive", "core-complex"])
def test_numa_binding_without_cuda_is_one_line_and_exit_2(workdir: Path, mode: str) -> None:
    code, err, config = main_for_test(["--numa-binding", mode, SCRIPT])
    assert (code, config) == (2, None) and err.count("\n") == 1 and "Traceback" not in err
    assert f"--numa-binding {mode}: binds each worker to the CPUs nearest the GPU" in err
    assert "leave --numa-binding out" in err


def test_numa_binding_with_cuda_puts_the_binding_before_each_worker(
        workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Accepted where CUDA is (stood in for here): the worker command is bound first."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    code, err, config = main_for_test(["--numa-binding", "socket", SCRIPT, "--lr", "1"])
    assert code == 0 and config is not None, err
    assert config.entrypoint[1:5] == ["-m", "elastictk.supervisor.numabind", "socket", "--"]
    assert config.entrypoint[5:] == [config.entrypoint[0], "-u", SCRIPT, "--lr", "1"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_gpu_workers_without_cuda_is_a_usage_error(workdir: Path) -> None:
    code, err, _ = main_for_test(["--nproc-per-node", "gpu", SCRIPT])
    assert code == 2 and "CUDA is not available" in err


@pytest.mark.parametrize("env,needle", [
    ({"PET_NNODES": "3:2"}, "PET_NNODES='3:2': min 3 > max 2"),
    ({"PET_STANDALONE": "maybe"}, "PET_STANDALONE='maybe': 'maybe' is not a boolean"),
    ({"PET_MAX_RESTARTS": "-2"}, "PET_MAX_RESTARTS='-2': must be at least 0"),
    ({"ELASTICTK_RECOVERY": "never"}, "ELASTICTK_RECOVERY='never': use one of"),
    ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon'"),
])
def test_bad_environment_value_names_the_variable(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], needle: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, err, _ = main_for_test([SCRIPT])
    assert code == 2 and err.count("\n") == 1 and needle in err


def test_usage_error_exits_2_without_traceback_in_a_real_process(workdir: Path) -> None:
    code = ("import sys; from elastictk.cli.args import parse_or_exit; "
            "parse_or_exit(sys.argv[1:]); print('parsed')")
    proc = subprocess.run(
        [sys.executable, "-c", code, "--nnodes", "3:2", SCRIPT],
        capture_output=True, text=True, timeout=120, cwd=workdir,
    )
    assert proc.returncode == 2
    assert proc.stderr == ("elastictk-run: error: --nnodes 3:2: min 3 > max 2: use --nnodes "
                           "MIN:MAX with MIN <= MAX\n")
    assert proc.stdout == ""


def test_help_exits_0(workdir: Path) -> None:
    code, _, config = main_for_test(["--help"])
    assert code == 0 and config is None


def test_master_port_in_use_is_named(workdir: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code, err, _ = main_for_test(["--master-port", str(port), SCRIPT])
        assert code == 2
        assert f"--master-port {port}: the port is already in use" in err
        # node rank 1 does not host the store, so the port being taken is no problem there
        code, _, config = main_for_test(["--nnodes", "2", "--node-rank", "1", "--master-port",
                                         str(port), SCRIPT])
        assert code == 0 and config is not None and config.store_port_to_bind() is None


def test_busy_c10d_port_is_an_error_only_with_is_host(workdir: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        base = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}"]
        # inferred host: like torch, this agent becomes a client when another one hosts the store
        assert main_for_test([*base, SCRIPT])[0] == 0
        code, err, _ = main_for_test([*base, "--rdzv-conf", "is_host=1", SCRIPT])
        assert code == 2 and f"port {port} is already in use" in err


def test_metrics_port_in_use_is_named(workdir: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code, err, _ = main_for_test(["--metrics-port", str(port), SCRIPT])
        assert code == 2 and f"--metrics-port {port}: already in use" in err


def test_standalone_overrides_rdzv_flags_with_a_warning(workdir: Path) -> None:
    code, err, config = main_for_test(["--standalone", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                                       "x:1", "--nnodes", "1:4", SCRIPT])
    assert code == 0 and config is not None
    assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == Endpoint("localhost", 0)
    assert (config.min_nodes, config.max_nodes) == (1, 1) and config.standalone
    assert "ignores --rdzv-backend, --rdzv-endpoint" in err and "ignoring --nnodes 1:4" in err
    assert all(line.startswith("elastictk-run: warning: ") for line in err.splitlines())


def test_two_standalone_runs_get_different_ids(workdir: Path) -> None:
    first, second = parse_args(["--standalone", SCRIPT]), parse_args(["--standalone", SCRIPT])
    assert first.run_id != second.run_id


@pytest.mark.parametrize("argv,needle", [
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--node-rank", "1", SCRIPT],
     "--node-rank is only used by the static backend"),
    (["--run-path", "--no-python", SCRIPT], "--run-path takes precedence"),
    (["--rdzv-token", "s3cret", SCRIPT], "prefer the ELASTICTK_RDZV_TOKEN"),
])
def test_ignored_flags_are_warned_about(workdir: Path, argv: list[str], needle: str) -> None:
    code, err, config = main_for_test(argv)
    assert code == 0 and config is not None and needle in err


def test_elastictk_flags_and_their_environment(workdir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTICTK_RDZV_TOKEN", "s3cret")
    monkeypatch.setenv("ELASTICTK_RECOVERY", "in-place")
    config = parse_args(["--collective-timeout", "30", "--metrics-port", "0", "--metrics-host",
                         "::1", "--restart-intensity", "3/60", "--restart-backoff", "0.5",
                         "--grace-period", "2.5", "--event-log", "ev.jsonl", SCRIPT])
    assert config.recovery == "in-place" and config.rdzv_token == "s3cret"
    assert "s3cret" not in repr(config) and config.warnings == ()
    assert (config.collective_timeout, config.metrics_port, config.metrics_host) == (30.0, 0, "::1")
    assert config.restart_intensity == (3, 60.0) and config.restart_backoff == 0.5
    assert config.grace_period == 2.5 and config.event_log == "ev.jsonl"
    defaults = parse_args([SCRIPT], environ={})
    assert (defaults.recovery, defaults.metrics_host, defaults.grace_period) == \
        ("restart-all", "127.0.0.1", 30.0)
    assert parse_args(["--start-method", "preload", SCRIPT]).start_method == "preload"


def test_torchrun_keep_alive_settings_become_heartbeats(workdir: Path) -> None:
    conf = parse_args(["--rdzv-conf", "keep_alive_interval=2,keep_alive_max_attempt=4",
                       SCRIPT]).rdzv_conf
    assert conf == {"heartbeat_interval": 2.0, "heartbeat_timeout": 8.0}
    assert parse_rdzv_conf("keep_alive_max_attempt=3", "x") == {"heartbeat_timeout": 15.0}


def test_file_backend_takes_a_path(workdir: Path) -> None:
    config = parse_args(["--nnodes", "1:3", "--rdzv-backend", "file", "--rdzv-endpoint",
                         str(workdir / "rdzv"), SCRIPT])
    assert config.rdzv_path == str(workdir / "rdzv") and config.rdzv_endpoint is None


def test_no_python_program_by_path(workdir: Path) -> None:
    prog = workdir / "prog.sh"
    prog.write_text("#!/bin/sh\nexit 0\n")
    code, err, _ = main_for_test(["--no-python", str(prog)])
    assert code == 2 and "not an executable file" in err
    prog.chmod(prog.stat().st_mode | stat.S_IXUSR)
    config = parse_args(["--no-python", str(prog), "a"])
    assert config.entrypoint == [str(prog), "a"]


def test_config_built_for_another_host_skips_local_checks(workdir: Path) -> None:
    config = parse_args(["missing.py"], check=False)
    assert config.training_script == "missing.py"


def test_validate_lists_every_problem() -> None:
    config = LaunchConfig(
        min_nodes=3, max_nodes=2, nproc_per_node=0, rdzv_backend="c10d",
        rdzv_endpoint=Endpoint("h", 1), run_id="a/b", entrypoint=["python", "x.py"],
        training_script="x.py", max_restarts=-1, start_method="thread", recovery="never",
    )
    problems = validate(config)
    assert len(problems) == 6 and all("\n" not in p for p in problems)
    assert problems[0] == "min 3 > max 2: use --nnodes MIN:MAX with MIN <= MAX"
    fine = dataclasses.replace(config, min_nodes=1, nproc_per_node=1, run_id="a",
                               max_restarts=0, start_method="spawn", recovery="in-place")
    assert validate(fine) == []


# --- properties of the pure parsers ---------------------------------------------------------

@given(st.integers(-5, 40), st.integers(-5, 40))
def test_nnodes_min_max_accepted_exactly_when_ordered(lo: int, hi: int) -> None:
    text = f"{lo}:{hi}"
    if 1 <= lo <= hi:
        assert parse_nnodes(text) == (lo, hi) == torchrun.parse_min_max_nnodes(text)
    else:
        with pytest.raises(UsageError) as e:
            parse_nnodes(text)
        assert "\n" not in str(e.value) and "--nnodes" in str(e.value)


@given(st.integers(-5, 40))
def test_nnodes_single_number(n: int) -> None:
    if n >= 1:
        assert parse_nnodes(str(n)) == (n, n)
    else:
        with pytest.raises(UsageError):
            parse_nnodes(str(n))


@given(st.text(max_size=12))
def test_nnodes_any_text_is_a_valid_range_or_one_usage_error(text: str) -> None:
    try:
        lo, hi = parse_nnodes(text)
    except UsageError as e:
        assert "\n" not in str(e)
    else:
        assert 1 <= lo <= hi


_TIMEOUT_KEYS = ["join_timeout", "last_call_timeout", "close_timeout", "timeout", "read_timeout"]


@given(st.dictionaries(st.sampled_from(_TIMEOUT_KEYS), st.integers(1, 10_000), max_size=5),
       st.booleans())
def test_rdzv_conf_round_trips(values: dict[str, int], is_host: bool) -> None:
    text = ",".join([f"{k}={v}" for k, v in values.items()] + [f"is_host={str(is_host).lower()}"])
    assert parse_rdzv_conf(text, "x") == {**{k: float(v) for k, v in values.items()},
                                          "is_host": is_host}


@given(st.dictionaries(st.integers(0, 9), st.integers(0, 3), min_size=1, max_size=10))
@settings(max_examples=50)
def test_std_mapping_matches_torch(mapping: dict[int, int]) -> None:
    text = ",".join(f"{r}:{v}" for r, v in mapping.items())
    ours = parse_std(text, "-r")
    theirs = TorchStd.from_str(text)
    assert isinstance(ours, dict) and isinstance(theirs, dict)
    assert {r: int(s) for r, s in ours.items()} == {r: int(s) for r, s in theirs.items()}
    assert all(isinstance(s, Std) for s in ours.values())


def test_etcd_endpoint_lists_every_cluster_member(workdir: Path) -> None:
    config = parse_args(["--rdzv-backend", "etcd", "--rdzv-endpoint", "10.0.0.1:2379, 10.0.0.2,[::1]:2400",
                         "--nnodes", "2", "train.py"])
    assert config.rdzv_endpoints == (Endpoint("10.0.0.1", 2379), Endpoint("10.0.0.2", 2379), Endpoint("::1", 2400))
    assert config.rdzv_endpoint == Endpoint("10.0.0.1", 2379)
    code, err, _ = main_for_test(["--rdzv-backend", "etcd", "--rdzv-endpoint", "a:1,b:x", "--nnodes", "2", "t.py"])
    assert code == 2 and "b:x" in err and len(err.strip().splitlines()) == 1


def test_duplicate_filters_without_tee_warn_with_the_fix(workdir: Path) -> None:
    config = parse_args(["--duplicate-stderr-filters", "x", "-t", "1", SCRIPT])
    assert config.duplicate_stderr_filters == ("x",)
    (line,) = config.warnings
    assert "--duplicate-stderr-filters" in line and "--tee 2" in line
    assert not parse_args(["--duplicate-stdout-filters", "x", "-t", "0:1", SCRIPT]).warnings


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab,, x\u00e9"), max_size=12))
def test_duplicate_filters_split_as_torchrun_splits_them(text: str) -> None:
    """Any text, through torchrun's own parser: the same items, less the empty ones."""
    theirs = torchrun.get_args_parser().parse_args(
        [f"--duplicate-stdout-filters={text}", SCRIPT]).duplicate_stdout_filters
    assert parse_filters(text) == tuple(f for f in theirs if f)

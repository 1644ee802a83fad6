"""Bad input to elastictk-run and elastictk-chaos: one line on stderr naming the flag (or the
report field) and the fix, exit code 2; never a traceback, never a fork storm.

Every case is a real command line in a subprocess (``python -m elastictk.run``/``-m
elastictk.chaos``), so what is checked is what a user sees.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from elastictk.cli import LaunchConfig, parse_args, validate
from elastictk.cli.config import max_nproc_per_node
from elastictk.faults import plan_of
from elastictk.store.endpoint import Endpoint

TINY = "print('tiny worker ran')\n"
# A rendezvous whose job id is used (a lone node otherwise gets a random id, as with torchrun).
C10D = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    script = tmp_path / "tiny.py"
    script.write_text(TINY)
    return script


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTICTK_"))}


def cli(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=240)  # a hang guard: 30 s ran out under load


def assert_one_line(r: subprocess.CompletedProcess[str], prog: str, *names: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert line.startswith(f"{prog}: error: "), line
    for name in names:
        assert name in line, (name, line)
    return line


# --- elastictk-run --------------------------------------------------------------------------

RUN_CASES = [
    (["--collective-timeout", "1e10"], ["--collective-timeout 1e10", "at most 86400"]),
    (["--collective-timeout", "86401"], ["--collective-timeout", "at most 86400"]),
    (["--collective-timeout", "nan"], ["--collective-timeout", "finite number more than 0"]),
    (["--collective-timeout", "inf"], ["--collective-timeout", "finite number more than 0"]),
    (["--collective-timeout", "0"], ["--collective-timeout", "more than 0"]),
    (["--collective-timeout", "-3"], ["--collective-timeout", "more than 0"]),
    (["--restart-backoff", "61"], ["--restart-backoff", "at most 60"]),
    ([*C10D, "--rdzv-id", ".."], ["--rdzv-id ..", "cannot be a job id", "--log-dir"]),
    ([*C10D, "--rdzv-id", "."], ["--rdzv-id .", "cannot be a job id"]),
    ([*C10D, "--rdzv-id", "a/b"], ["--rdzv-id a/b", "no '/'"]),
    ([*C10D, "--rdzv-id", ""], ["--rdzv-id ''", "non-empty"]),
    ([*C10D, "--rdzv-id", "a\nb"], ["--rdzv-id 'a\\nb'", "control character"]),
    ([*C10D, "--rdzv-id", "a\x01b"], ["--rdzv-id 'a\\x01b'", "control character"]),
    ([*C10D, "--rdzv-id", "j" * 200], ["--rdzv-id", "200 bytes long, at most 128"]),
    (["--straggler-interval", "1e-9"], ["--straggler-interval 1e-9", "at least 0.1"]),
    (["--local-addr", "999.1.1.1"], ["--local-addr 999.1.1.1", "not an IPv4 address"]),
    (["--local-addr", "nohost.invalid"], ["--local-addr nohost.invalid", "cannot resolve host"]),
]


def _case_id(args: list[str]) -> str:
    shown = args[len(C10D):] if args[:len(C10D)] == C10D else args
    return " ".join(shown)[:40]


@pytest.mark.parametrize("args,names", RUN_CASES, ids=[_case_id(a) for a, _ in RUN_CASES])
def test_run_refuses_with_one_line(tmp_path: Path, tiny: Path, args: list[str], names: list[str]) -> None:
    r = cli("elastictk.run", *args, str(tiny), cwd=tmp_path)
    assert_one_line(r, "elastictk-run", *names)
    assert "tiny worker ran" not in r.stdout


def test_a_log_dir_under_a_file_is_refused_before_any_worker(tmp_path: Path, tiny: Path) -> None:
    # A regular file as the parent fails for root too (NotADirectoryError), unlike permissions.
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory\n")
    r = cli("elastictk.run", "--log-dir", str(blocker / "logs"), str(tiny), cwd=tmp_path)
    line = assert_one_line(r, "elastictk-run", f"--log-dir {blocker / 'logs'}", "is a file",
                           "pick a directory")
    assert str(blocker) in line and "tiny worker ran" not in r.stdout
    deeper = cli("elastictk.run", "--log-dir", str(blocker / "a" / "b"), str(tiny), cwd=tmp_path)
    assert_one_line(deeper, "elastictk-run", "--log-dir", f"{blocker} is a file")
    itself = cli("elastictk.run", "--log-dir", str(blocker), str(tiny), cwd=tmp_path)
    assert_one_line(itself, "elastictk-run", f"--log-dir {blocker}", "not a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to a read-only directory")
def test_a_read_only_log_dir_is_refused(tmp_path: Path, tiny: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        r = cli("elastictk.run", "--log-dir", str(ro / "logs"), str(tiny), cwd=tmp_path)
    finally:
        ro.chmod(0o700)
    assert_one_line(r, "elastictk-run", "--log-dir", "not writable")


def _kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for p in [*root.children(recursive=True), root]:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run_watching_children(argv: list[str], cwd: Path, limit: float = 30) -> tuple[int, str, int]:
    """Run ``argv``, polling its process tree; ``(exit code, stderr, most children seen)``.
    The tree is killed by PID on the way out, so even a failing check forks no storm."""
    proc = subprocess.Popen(argv, cwd=cwd, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    most = 0
    try:
        deadline = time.monotonic() + limit
        while proc.poll() is None:
            try:
                most = max(most, len(psutil.Process(proc.pid).children(recursive=True)))
            except psutil.NoSuchProcess:
                break
            assert most <= 4, f"{most} child processes: workers are being started"
            assert time.monotonic() < deadline, "still running: the bad value was accepted"
            time.sleep(0.02)
        _, err = proc.communicate(timeout=limit)
        return proc.wait(), err, most
    finally:
        _kill_tree(proc.pid)
        proc.wait()


def test_a_huge_nproc_per_node_starts_no_worker(tmp_path: Path, tiny: Path) -> None:
    code, err, most = _run_watching_children(
        [sys.executable, "-m", "elastictk.run", "--nproc-per-node", "100000", str(tiny)], tmp_path)
    r = subprocess.CompletedProcess([], code, "", err)
    assert_one_line(r, "elastictk-run", "--nproc-per-node 100000",
                    f"at most {max_nproc_per_node()} workers", "each worker is a process")
    assert most <= 4


def test_the_nproc_bound_is_at_least_1024_and_four_per_cpu() -> None:
    assert max_nproc_per_node() == max(1024, 4 * (os.cpu_count() or 1))


def test_values_at_the_bounds_still_pass(tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The passing side: the largest accepted values parse, and a valid run with a fresh log dir
    below a new directory, a plain job id and a day-long collective timeout runs to the end."""
    monkeypatch.chdir(tmp_path)
    config = parse_args(["--collective-timeout", "86400", "--restart-backoff", "60",
                         "--nproc-per-node", str(max_nproc_per_node()), *C10D, "--rdzv-id",
                         "j" * 128, str(tiny)], environ={}, check=False)
    assert (config.collective_timeout, config.restart_backoff) == (86400.0, 60.0)
    assert config.nproc_per_node == max_nproc_per_node() and config.run_id == "j" * 128
    logs = tmp_path / "new" / "logs"
    r = subprocess.run([sys.executable, "-m", "elastictk.run", "--collective-timeout", "86400",
                        "--log-dir", str(logs), *C10D, "--rdzv-id", "job-1.a_b", str(tiny)],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tiny worker ran" in r.stdout and (logs / "job-1.a_b").is_dir()


def test_validate_names_the_same_problems_for_a_config_built_in_python() -> None:
    base = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, rdzv_backend="c10d",
                        rdzv_endpoint=Endpoint("localhost", 0), run_id="job",
                        entrypoint=["python", "x.py"], training_script="x.py")
    assert validate(base) == []
    assert any("'..' cannot be a job id" in p for p in validate(dataclasses.replace(base, run_id="..")))
    assert any("at most 86400" in p for p in validate(dataclasses.replace(base, collective_timeout=1e10)))
    assert any("at most 60" in p for p in validate(dataclasses.replace(base, restart_backoff=61.0)))


# --- elastictk-chaos ------------------------------------------------------------------------

def _report(tmp: Path, tiny: Path, **fields: object) -> Path:
    d: dict[str, object] = {"schema": "elastictk.chaos-report/1", "plan": plan_of([]).to_json(),
                            "launcher_flags": ["--nproc-per-node", "1"], "command": [str(tiny)]}
    d.update(fields)
    path = tmp / "old-report.json"
    path.write_text(json.dumps(d))
    return path


REPLAY_CASES = [
    ({"multinode": {"nodes": "three"}}, ["multinode.nodes is a string \"three\"", "whole number"]),
    ({"multinode": {"nodes": [2]}}, ["multinode.nodes is a list [2]"]),
    ({"multinode": {"nodes": 2.5}}, ["multinode.nodes is a number 2.5"]),
    ({"multinode": {"nodes": 100000}}, ["multinode.nodes is 100000, more than 64"]),
    ({"multinode": "3 nodes"}, ["multinode is a string, not an object"]),
    ({"multinode": {"nodes": 2, "rejoin_s": "soon"}}, ["multinode.rejoin_s is a string"]),
    ({"launcher_flags": "--nproc-per-node 2"}, ["launcher_flags is a string", "not a list of strings"]),
    ({"launcher_flags": {"--nproc-per-node": 2}}, ["launcher_flags is an object"]),
    ({"launcher_flags": ["--nproc-per-node", 2]}, ["launcher_flags holds a number 2"]),
    ({"command": 7}, ["command is a number 7", "not a list of strings"]),
]


@pytest.mark.parametrize("fields,names", REPLAY_CASES, ids=[json.dumps(f)[:40] for f, _ in REPLAY_CASES])
def test_replay_of_a_report_with_a_wrong_type_is_one_line(tmp_path: Path, tiny: Path, fields: dict,
                                                          names: list[str]) -> None:
    path = _report(tmp_path, tiny, **fields)
    r = cli("elastictk.chaos", "--report-dir", str(tmp_path / "r"), "--replay", str(path), cwd=tmp_path)
    assert_one_line(r, "elastictk-chaos", str(path), *names)
    assert not (tmp_path / "r").exists()


def test_chaos_bounds_nodes_and_workers(tmp_path: Path, tiny: Path) -> None:
    code, err, most = _run_watching_children(
        [sys.executable, "-m", "elastictk.chaos", "--report-dir", str(tmp_path / "r"), "--nodes",
         "100000", "--nproc-per-node", "1", "--", str(tiny)], tmp_path)
    assert_one_line(subprocess.CompletedProcess([], code, "", err), "elastictk-chaos",
                    "--nodes 100000", "at most 64", "each node is an agent process")
    code, err, most2 = _run_watching_children(
        [sys.executable, "-m", "elastictk.chaos", "--report-dir", str(tmp_path / "r"),
         "--nproc-per-node", "100000", "--", str(tiny)], tmp_path)
    assert_one_line(subprocess.CompletedProcess([], code, "", err), "elastictk-chaos",
                    "--nproc-per-node 100000", "each worker is a process")
    assert max(most, most2) <= 4 and not (tmp_path / "r").exists()
    r = cli("elastictk.chaos", "--report-dir", str(tmp_path / "r"), "--collective-timeout", "1e10",
            "--nproc-per-node", "1", "--", str(tiny), cwd=tmp_path)
    assert_one_line(r, "elastictk-chaos", "--collective-timeout 1e10", "at most 86400")


# --- inputs that are only wrong on this machine: each refused before any worker starts -----

# Each row: an id, the command line ("{tmp}" is the test's directory, "{script}" the tiny
# script, "{file}" a regular file, "{dir}" an empty directory), and what the one line names.
LAUNCH_CASES = [
    ("log-dir-in-proc", ["--log-dir", "/proc/x", "{script}"],
     ["--log-dir /proc/x", "cannot create a directory in /proc", "pick a writable directory"]),
    # refused: a node that does not host the store first waits read_timeout for it (one
    # "waiting" line, see the test), as torch's client does
    ("c10d-refused", ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf",
                      "is_host=false,read_timeout=0.5", "--nnodes", "2", "{script}"],
     ["cannot reach the TCPStore at 127.0.0.1:1", "connection refused", "--rdzv-endpoint"]),
    ("c10d-unresolvable", ["--rdzv-backend", "c10d", "--rdzv-endpoint", "nohost.invalid:29400",
                           "--nnodes", "2", "{script}"],
     ["--rdzv-endpoint nohost.invalid:29400", "cannot resolve host nohost.invalid"]),
    # port 0: a fixed port may be held by another job on this host, refused before the name is looked up
    ("c10d-unresolvable-host", ["--rdzv-backend", "c10d", "--rdzv-endpoint", "nohost.invalid:0",
                                "--rdzv-conf", "is_host=true", "{script}"],
     ["--rdzv-endpoint nohost.invalid:0", "cannot resolve host nohost.invalid"]),
    ("static-unresolvable", ["--nnodes", "2", "--master-addr", "nohost.invalid", "--master-port",
                             "29555", "--node-rank", "1", "{script}"],
     ["--master-addr nohost.invalid", "cannot resolve host nohost.invalid"]),
    ("static-refused", ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "1",
                        "--node-rank", "1", "--rdzv-conf", "read_timeout=0.5", "{script}"],
     ["cannot reach the TCPStore at 127.0.0.1:1", "--master-addr/--master-port"]),
    ("ranks-filter-past-nproc", ["--nproc-per-node", "2", "--local-ranks-filter", "5", "{script}"],
     ["--local-ranks-filter 5", "local ranks 0..1", "--nproc-per-node 2"]),
    ("event-log-under-a-file", ["--event-log", "{file}/ev.jsonl", "{script}"],
     ["--event-log {file}/ev.jsonl", "{file} is a file"]),
    ("event-log-a-directory", ["--event-log", "{dir}", "{script}"],
     ["--event-log {dir}", "is a directory", "give a file path"]),
    ("script-a-directory", ["{dir}"],
     ["training script '{dir}' is a directory", "__main__.py"]),
    ("snapshot-dir-a-file", ["--snapshot-dir", "{file}", "{script}"],
     ["--snapshot-dir {file}", "is not a directory"]),
    # root passes os.access on /proc: was accepted, and the disk tier failed after training
    ("snapshot-dir-in-proc", ["--snapshot-dir", "/proc/x", "{script}"],
     ["--snapshot-dir /proc/x", "cannot create a directory in /proc"]),
    # every user writes /tmp: the first fix is a private subdirectory, not chmod go-w /tmp
    ("snapshot-dir-tmp", ["--snapshot-dir", "/tmp", "{script}"],
     ["--snapshot-dir /tmp", "private subdirectory, e.g. --snapshot-dir /tmp/", "(created mode 0700)"]),
    # exit 127/126 at every check kept the node out of its job forever
    ("health-check-missing", ["--health-check", "{tmp}/no-such-check", "{script}"],
     ["--health-check '{tmp}/no-such-check'", "does not exist", "127"]),
    ("health-check-not-on-path", ["--health-check", "no-such-check-xyz --gpu", "{script}"],
     ["no-such-check-xyz is not on PATH", "127"]),
    ("health-check-not-executable", ["--health-check", "{file}", "{script}"],
     ["{file} is not executable", "chmod +x"]),
    ("static-min-max", ["--nnodes", "1:2", "--master-port", "29556", "{script}"],
     ["--nnodes 1:2", "static", "fixed", "--rdzv-backend c10d"]),
]


@pytest.mark.parametrize("args,names", [(a, n) for _, a, n in LAUNCH_CASES],
                         ids=[i for i, _, _ in LAUNCH_CASES])
def test_launch_refuses_with_one_line_before_any_worker(tmp_path: Path, tiny: Path,
                                                        args: list[str], names: list[str]) -> None:
    (tmp_path / "a-file").write_text("not a directory\n")
    (tmp_path / "a-dir").mkdir()
    where = {"{script}": str(tiny), "{file}": str(tmp_path / "a-file"),
             "{dir}": str(tmp_path / "a-dir"), "{tmp}": str(tmp_path)}

    def fill(text: str) -> str:
        for key, value in where.items():
            text = text.replace(key, value)
        return text

    # The run's timeout guards a hang only (no wall-clock bound: a loaded host starts Python
    # slowly); "before any worker" is the worker's own line never printed.
    r = subprocess.run([sys.executable, "-m", "elastictk.run", *map(fill, args)], cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=240)
    if "--rdzv-conf" in args and "read_timeout=0.5" in args[args.index("--rdzv-conf") + 1]:
        waiting, _, rest = r.stderr.partition("\n")
        assert "waiting up to 0.5s for the store at 127.0.0.1:1" in waiting, r.stderr
        r = subprocess.CompletedProcess(r.args, r.returncode, r.stdout, rest)
    assert_one_line(r, "elastictk-run", *map(fill, names))
    assert "tiny worker ran" not in r.stdout


def test_version_prints_the_version_and_exits_0(tmp_path: Path) -> None:
    from elastictk import __version__

    r = cli("elastictk.run", "--version", cwd=tmp_path)
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, f"elastictk-run {__version__}", ""), r

"""The worker group with real workers: env and return values, exits seen as they happen, logs.

Function workers run under spawn/fork/forkserver (torch.multiprocessing) and the preload server;
script, module and binary workers under subprocess and the preload server.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator

import pytest

from elastictk.supervisor.env import Assignment
from elastictk.supervisor.forkserver import PreloadServer
from elastictk.supervisor.group import GroupStateError, WorkerGroup
from elastictk.supervisor.logs import LogDirError, claim_run_dir
from elastictk.supervisor.report import failure_of
from elastictk.supervisor.process import WorkerStartError
from elastictk.supervisor.spec import Std, WorkerSpec, python_module_argv, python_script_argv
from tests.helpers import supervisor_workers as sw


def assignment(lws: int = 2, group_rank: int = 1, nodes: int = 2, **kw: object) -> Assignment:
    """By default node 1 of 2, so global ranks differ from local ranks."""
    base = dict(master_addr="127.0.0.1", master_port=29511, run_id="job", max_restarts=3)
    return Assignment.homogeneous(group_rank, nodes, lws, **{**base, **kw})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def server() -> Iterator[PreloadServer]:
    """A preload server that preloads something small (torch would cost seconds per test run)."""
    with PreloadServer(preload=["decimal", "json"]) as s:
        yield s


def script(tmp_path: Path, text: str, name: str = "worker.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- environment and return values --------------------------------------------------------------

@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver", "preload"])
def test_function_workers_get_torchrun_env_and_return_values(
        tmp_path: Path, method: str, server: PreloadServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    spec = WorkerSpec(sw.report_env, args=("r${local_rank}",), local_world_size=2,
                      start_method=method, redirects=Std.ALL, env={"EXTRA": "yes"})
    with WorkerGroup(spec, tmp_path, preload_server=server) as g:
        g.start(0, assignment(restart_count=1))
        results = g.wait(timeout=120)
        assert g.running == []
    for lr in (0, 1):
        r = results[lr]
        assert (r.exitcode, r.rank, r.local_rank, r.signal_name) == (0, 2 + lr, lr, None)
        value = r.return_value
        assert value["tag"] == f"r{lr}" and value["pid"] == r.pid == value["sid"]
        env = value["env"]
        assert env == {
            "RANK": str(2 + lr), "LOCAL_RANK": str(lr), "GROUP_RANK": "1", "ROLE_RANK": str(2 + lr),
            "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4",
            "GROUP_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29511", "TORCHELASTIC_RESTART_COUNT": "1",
            "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "job",
            "TORCHELASTIC_ERROR_FILE": str(tmp_path / "job" / "attempt_0" / str(lr) / "error.json"),
            "TORCHELASTIC_USE_AGENT_STORE": "False", "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "2,3", "EXTRA": "yes",
        }
        assert r.error_file == env["TORCHELASTIC_ERROR_FILE"]
        assert Path(r.stdout_path or "").read_text() == f"out r{lr} rank={2 + lr}\n"
        assert Path(r.stderr_path or "").read_text() == f"err r{lr} rank={2 + lr}\n"


def test_return_value_larger_than_a_pipe_buffer(tmp_path: Path) -> None:
    spec = WorkerSpec(sw.big_value, args=(5_000_000,), local_world_size=2, start_method="fork")
    with WorkerGroup(spec, tmp_path) as g:
        g.start(0, assignment())
        results = g.wait(timeout=120)
    assert [len(results[lr].return_value) for lr in (0, 1)] == [5_000_000, 5_000_000]


@pytest.mark.parametrize("method", ["subprocess", "preload"])
def test_script_workers_get_argv_env_and_exit_codes(
        tmp_path: Path, method: str, server: PreloadServer) -> None:
    spec = WorkerSpec(python_script_argv(script(tmp_path, sw.ENV_SCRIPT), "--lr=${local_rank}"),
                      local_world_size=2, start_method=method, redirects=Std.ALL,
                      env={"EXIT_CODE": "5"})
    with WorkerGroup(spec, tmp_path / "logs", preload_server=server) as g:
        g.start(0, assignment())
        results = g.wait(timeout=120)
    for lr in (0, 1):
        assert results[lr].exitcode == 5
        out = Path(results[lr].stdout_path or "").read_text()
        assert out == f"hello from {2 + lr} argv ['--lr={lr}']\npartial line without newline"
        assert Path(results[lr].stderr_path or "").read_text() == f"to stderr {2 + lr}\n"


@pytest.mark.parametrize("method", ["subprocess", "preload"])
def test_module_workers_run_as_main(tmp_path: Path, method: str, server: PreloadServer,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        "import os, sys\nif __name__ == '__main__':\n"
        "    print('module', __name__, os.environ['LOCAL_RANK'], sys.argv[1:])\n"
        "    print('decimal preloaded:', 'decimal' in sys.modules)\n")
    monkeypatch.chdir(tmp_path)
    spec = WorkerSpec(python_module_argv("mypkg.train", "a"), local_world_size=1,
                      start_method=method, redirects=Std.OUT)
    with WorkerGroup(spec, tmp_path / "logs", preload_server=server) as g:
        g.start(0, assignment(lws=1))
        result = g.wait(timeout=120)[0]
    out = Path(result.stdout_path or "").read_text().splitlines()
    assert result.exitcode == 0 and out[0] == "module __main__ 0 ['a']"
    # a preloaded worker finds the server's imports already done; a fresh interpreter does not
    assert out[1] == f"decimal preloaded: {method == 'preload'}"


def test_binary_workers_and_a_missing_binary(tmp_path: Path) -> None:
    spec = WorkerSpec(["/bin/sh", "-c", 'echo "$RANK $LOCAL_WORLD_SIZE"; exit 4'],
                      local_world_size=2, redirects=Std.OUT)
    with WorkerGroup(spec, tmp_path) as g:
        g.start(0, assignment())
        results = g.wait(timeout=60)
    assert [Path(results[lr].stdout_path or "").read_text() for lr in (0, 1)] == ["2 2\n", "3 2\n"]
    assert {r.exitcode for r in results.values()} == {4}
    with WorkerGroup(WorkerSpec([str(tmp_path / "nope")]), tmp_path) as g:
        with pytest.raises(WorkerStartError, match="nope"):
            g.start(0, assignment(lws=1))


def test_unpicklable_function_fails_to_start_with_one_line(tmp_path: Path) -> None:
    spec = WorkerSpec(lambda: 1, local_world_size=2, start_method="spawn")
    with WorkerGroup(spec, tmp_path) as g:
        with pytest.raises(WorkerStartError, match="picklable") as e:
            g.start(0, assignment())
        assert "\n" not in str(e.value)
        assert g.running == []


# -- exits observed as they happen ----------------------------------------------------------------

FAILURES = [("exception", 1, None), ("exit3", 3, None), ("sigkill", -9, "SIGKILL"),
            ("sigsegv", -11, "SIGSEGV")]


@pytest.mark.parametrize("how, code, name", FAILURES)
@pytest.mark.parametrize("kind", ["script", "function"])
def test_a_failing_worker_is_reported_while_the_others_still_run(
        tmp_path: Path, kind: str, how: str, code: int, name: str | None) -> None:
    if kind == "script":
        spec = WorkerSpec(python_script_argv(script(tmp_path, sw.FAIL_SCRIPT), how),
                          local_world_size=3, redirects=Std.ALL)
    else:
        spec = WorkerSpec(sw.fail, args=(how,), local_world_size=3, start_method="fork",
                          redirects=Std.ALL)
    with WorkerGroup(spec, tmp_path / "logs") as g:
        g.start(0, assignment(lws=3, group_rank=0))
        first = g.wait_any(timeout=120)
        assert [r.local_rank for r in first] == [1]
        assert g.running == [0, 2], "the group waited for the other workers"
        r = first[0]
        assert (r.exitcode, r.signal_name, r.stopped) == (code, name, False)
        assert r.ended_at >= r.started_at
        stopped = g.stop(grace=30)
    assert {stopped[lr].signal_name for lr in (0, 2)} == {"SIGTERM"}
    assert all(stopped[lr].stopped for lr in (0, 2))
    if how == "exception":
        assert "ValueError: worker failed on purpose" in Path(r.stderr_path or "").read_text()
    if how == "exception" and kind == "function":  # function workers run under @record
        payload = json.loads(Path(r.error_file or "").read_text())
        assert "worker failed on purpose" in json.dumps(payload)
    # the failure report reads a result as it is
    failure = failure_of(r, hostname="node0")
    assert (failure.rank, failure.pid, failure.signal) == (1, r.pid, r.signal)
    if how == "exception":
        text = "\n".join(failure.stderr_tail) + json.dumps(str(failure.error))
        assert "worker failed on purpose" in text


def test_wait_any_returns_at_once_when_nothing_runs(tmp_path: Path) -> None:
    with WorkerGroup(WorkerSpec(["/bin/true"]), tmp_path) as g:
        assert g.wait_any(timeout=60) == []
        g.start(0, assignment(lws=1))
        g.wait(timeout=60)
        t0 = time.monotonic()
        assert g.wait_any(timeout=60) == []
        assert time.monotonic() - t0 < 30


# -- logs ----------------------------------------------------------------------------------------

def test_logs_per_attempt_survive_later_attempts_and_reruns(tmp_path: Path) -> None:
    spec = WorkerSpec(["/bin/sh", "-c", 'echo "attempt $TORCHELASTIC_RESTART_COUNT"; echo e >&2'],
                      local_world_size=2, redirects=Std.ALL)
    logs = tmp_path / "logs"
    with WorkerGroup(spec, logs) as g:
        for attempt in (0, 1):
            g.start(attempt, assignment(restart_count=attempt))
            g.wait(timeout=60)
            g.stop()
        with pytest.raises(LogDirError, match="attempt_1 already exists"):
            g.start(1, assignment(restart_count=1))
        assert g.run_log_dir == logs / "job"
    for attempt in (0, 1):
        for lr in (0, 1):
            d = logs / "job" / f"attempt_{attempt}" / str(lr)
            assert (d / "stdout.log").read_text() == f"attempt {attempt}\n"
            assert (d / "stderr.log").read_text() == "e\n"
    with WorkerGroup(spec, logs) as again:  # a rerun with the same run id gets a fresh dir
        again.start(0, assignment(restart_count=7))
        results = again.wait(timeout=60)
        assert again.run_log_dir == logs / "job.1"
    assert results[0].stdout_path == str(logs / "job.1" / "attempt_0" / "0" / "stdout.log")
    assert (logs / "job" / "attempt_0" / "0" / "stdout.log").read_text() == "attempt 0\n"


@pytest.mark.parametrize("run_id", ["", "a/b", "..", "."])
def test_run_ids_that_cannot_name_a_directory_are_refused(tmp_path: Path, run_id: str) -> None:
    with pytest.raises(LogDirError, match="run id"):
        claim_run_dir(tmp_path, run_id)


def test_start_while_an_attempt_is_open_is_refused(tmp_path: Path) -> None:
    with WorkerGroup(WorkerSpec(["/bin/true"]), tmp_path) as g:
        g.start(0, assignment(lws=1))
        with pytest.raises(GroupStateError, match="stop"):
            g.start(1, assignment(lws=1))
        g.stop()
    with pytest.raises(GroupStateError, match="closed"):
        g.start(2, assignment(lws=1))


def test_tee_prefixes_console_lines_and_keeps_raw_files(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], server: PreloadServer) -> None:
    spec = WorkerSpec(python_script_argv(script(tmp_path, sw.ENV_SCRIPT)), local_world_size=3,
                      tee=Std.ALL, local_ranks_filter=frozenset({0, 2}), role="trainer")
    with WorkerGroup(spec, tmp_path / "logs") as g:
        g.start(0, assignment(lws=3, group_rank=0, nodes=1))
        results = g.wait(timeout=60)
        g.stop()
    out, err = capfd.readouterr()
    for lr in (0, 2):
        assert f"[trainer{lr}]:hello from {lr} argv []\n" in out
        assert f"[trainer{lr}]:partial line without newline\n" in out
        assert f"[trainer{lr}]:to stderr {lr}\n" in err
    assert "[trainer1]" not in out + err and "hello from 1" not in out  # filtered: file only
    raw = Path(results[1].stdout_path or "").read_text()
    assert raw == "hello from 1 argv []\npartial line without newline"


def test_prefix_template_and_redirect_without_tee_stays_off_the_console(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    spec = WorkerSpec(["/bin/sh", "-c", "echo tee-me; echo quiet >&2"], local_world_size=1,
                      tee=Std.OUT, redirects=Std.ERR,
                      log_line_prefix_template="${role_name}-${rank}-${local_rank}| ")
    with WorkerGroup(spec, tmp_path) as g:
        g.start(0, assignment(lws=1))
        result = g.wait(timeout=60)[0]
        g.stop()
    out, err = capfd.readouterr()
    assert "default-1-0| tee-me\n" in out
    assert "quiet" not in err and Path(result.stderr_path or "").read_text() == "quiet\n"


# -- preload server --------------------------------------------------------------------------------

def test_preload_server_reports_its_preload_and_dies_with_close() -> None:
    s = PreloadServer(preload=["json", "no_such_module_xyz"])
    s.start()
    report = s.wait_ready(timeout=120)
    pid = s.pid
    assert pid is not None and "no_such_module_xyz" in report["failed"]
    s.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_group_owns_the_preload_server_it_started(tmp_path: Path) -> None:
    spec = WorkerSpec(python_script_argv(script(tmp_path, "print('hi')\n")), start_method="preload")
    with WorkerGroup(spec, tmp_path / "logs", preload_modules=["json"]) as g:
        g.prepare()  # the import starts now, e.g. while rendezvous runs
        server_pid = g._starter.server.pid if g._starter.server else None
        assert server_pid is not None
        g.start(0, assignment(lws=1))
        assert g.wait(timeout=60)[0].exitcode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)


def test_preloaded_worker_killed_by_signal_and_restarted_from_the_same_server(
        tmp_path: Path, server: PreloadServer) -> None:
    spec = WorkerSpec(python_script_argv(script(tmp_path, sw.FAIL_SCRIPT), "sigsegv"),
                      local_world_size=2, start_method="preload", redirects=Std.ALL)
    with WorkerGroup(spec, tmp_path / "logs", preload_server=server) as g:
        for attempt in (0, 1):
            g.start(attempt, assignment())
            first = g.wait_any(timeout=120)
            assert [(r.local_rank, r.signal_name) for r in first] == [(1, "SIGSEGV")]
            assert g.stop(grace=30)[0].signal_name == "SIGTERM"
    assert server.pid is not None and os.kill(server.pid, 0) is None  # shared server lives on



def test_closing_a_server_that_is_still_importing_kills_it_at_once() -> None:
    """It has no children yet, so there is nothing to wait for: a launch that fails before its
    first worker (a bad store address) exits without sitting out torch's import."""
    s = PreloadServer()  # torch: seconds to import
    s.start()
    proc = s._proc
    assert proc is not None
    s.close()
    assert proc.returncode == -9


def test_wake_after_close_writes_into_no_reused_fd(tmp_path: Path) -> None:
    """A watch thread may call wake() after the agent closed its group; the fd numbers of the
    group's wake pipe are free by then and may belong to a file or socket opened since."""
    g = WorkerGroup(WorkerSpec(["/bin/true"]), tmp_path / "logs")
    old_w = g._exits._wake_w
    g.close()
    r, w = os.pipe()
    try:
        if w != old_w:  # make the old number (free: nothing else opened it) the write end
            with pytest.raises(OSError):
                os.fstat(old_w)
            os.dup2(w, old_w)
            os.close(w)
            w = old_w
        g.wake()
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):
            os.read(r, 1)
    finally:
        os.close(r)
        os.close(w)


def test_filtered_log_gathers_every_rank_and_an_in_place_replacement(tmp_path: Path) -> None:
    text = ("import os\nr = os.environ['LOCAL_RANK'], os.environ['TORCHELASTIC_RESTART_COUNT']\n"
            "print('hit', *r)\nprint('miss', *r)\nprint('last hit, no newline', *r, end='')\n")
    spec = WorkerSpec(python_script_argv(script(tmp_path, text)), local_world_size=2,
                      tee=Std.OUT, duplicate_stdout_filters=("hit",))
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        with WorkerGroup(spec, tmp_path / "logs", console=(null, null)) as g:
            g.start(0, assignment())
            assert all(r.exitcode == 0 for r in g.wait(timeout=60).values())
            g.respawn(1, 1, "gen_1")  # in place: its lines join the attempt's filtered file
            assert g.wait(timeout=60)[1].exitcode == 0
            attempt = g.attempt_dir
            assert attempt is not None
    finally:
        os.close(null)
    # Read once the group is closed, which drains its log pumps: a worker's exit (what wait()
    # returns on) can come before the pump has copied its last lines on a loaded host.
    lines = sorted((attempt / "filtered_stdout.log").read_text().splitlines())
    assert not (attempt / "filtered_stderr.log").exists()
    assert lines == sorted(f"[default{lr}]:{m} {lr} {c}" for lr, c in ((0, 0), (1, 0), (1, 1))
                           for m in ("hit", "last hit, no newline"))

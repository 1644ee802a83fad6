"""elastictk-run end to end: real agents, real workers, real signals.

The worker (tests/helpers/agent_worker.py) is tiny and imports no torch, so each launch costs about
one agent start-up; the full training example runs in test_demo.py.
"""
from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "helpers" / "agent_worker.py")


def launch(*flags: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "elastictk.run", *flags], cwd=cwd or ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})},
    )


def run(*flags: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    p = launch(*flags)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"elastictk-run did not finish in {timeout}s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def envs(out: Path) -> dict[str, dict[str, str]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}


STANDALONE = ("--standalone", "--nproc-per-node", "2", "--start-method", "spawn")


def test_worker_env_matches_torchrun(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "torch"
    ours.mkdir(), theirs.mkdir()
    r = run(*STANDALONE, "--max-restarts", "2", WORKER, str(ours))
    assert r.returncode == 0, r.stderr[-3000:]
    t = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "2", WORKER, str(theirs)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert t.returncode == 0, t.stderr[-3000:]
    a, b = envs(ours), envs(theirs)
    assert a.keys() == b.keys() == {"attempt0.rank0", "attempt0.rank1"}
    differ = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE",
              "TORCHELASTIC_USE_AGENT_STORE", "pid"}
    for tag in a:
        assert a[tag].keys() == b[tag].keys(), tag
        same = {k: v for k, v in a[tag].items() if k not in differ}
        assert same == {k: v for k, v in b[tag].items() if k not in differ}, tag
        assert a[tag]["TORCHELASTIC_ERROR_FILE"].endswith("error.json")
        assert int(a[tag]["MASTER_PORT"]) > 0
    assert a["attempt0.rank0"]["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("how,shown", [("SIGKILL", "SIGKILL"), ("SIGSEGV", "SIGSEGV"), ("exc", "ValueError"), ("exit:3", "exit code 3")])
def test_failed_worker_restarts_the_group(tmp_path: Path, how: str, shown: str) -> None:
    r = run(*STANDALONE, "--max-restarts", "1", WORKER, str(tmp_path), "--fail", f"0:1:{how}")
    assert r.returncode == 0, r.stderr[-3000:]
    e = envs(tmp_path)
    assert set(e) == {"attempt0.rank0", "attempt0.rank1", "attempt1.rank0", "attempt1.rank1"}
    assert e["attempt1.rank0"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert e["attempt1.rank0"]["TORCHELASTIC_MAX_RESTARTS"] == "1"
    assert e["attempt1.rank0"]["pid"] != e["attempt0.rank0"]["pid"], "the survivor was restarted too"
    assert shown in r.stderr


def test_job_fails_exactly_when_the_budget_is_spent(tmp_path: Path) -> None:
    r = run(*STANDALONE, "--max-restarts", "1", WORKER, str(tmp_path),
            "--fail", "0:1:SIGSEGV", "--fail", "1:0:exc")
    assert r.returncode == 1
    assert set(envs(tmp_path)) == {"attempt0.rank0", "attempt0.rank1", "attempt1.rank0", "attempt1.rank1"}
    assert "max-restarts" in r.stderr, r.stderr[-2000:]
    assert "injected failure on rank 0" in r.stderr, "the root cause's traceback comes from its error file"
    assert "ValueError" in r.stderr


def test_zero_restarts_names_the_signal(tmp_path: Path) -> None:
    r = run(*STANDALONE, WORKER, str(tmp_path), "--fail", "0:0:SIGSEGV")
    assert r.returncode == 1
    assert "SIGSEGV" in r.stderr
    assert not re.search(r"(?<![\d-])-11\b", r.stderr), "signals by name, never as -11"


def _wait_for(pred, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def _pids(e: dict[str, dict[str, str]]) -> list[int]:
    return [int(v[k]) for v in e.values() for k in ("pid", "child") if k in v]


def test_sigkilled_agent_leaves_no_worker_behind(tmp_path: Path) -> None:
    p = launch(*STANDALONE, WORKER, str(tmp_path), "--sleep", "120", "--child")
    try:
        _wait_for(lambda: len(envs(tmp_path)) == 2)
        pids = _pids(envs(tmp_path))
        assert len(pids) == 4 and all(psutil.pid_exists(x) for x in pids)
        p.kill()
        p.wait(10)
        _wait_for(lambda: not any(_alive(x) for x in pids), timeout=15)
    finally:
        p.kill()
        p.communicate()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigterm_is_forwarded_then_grace_then_sigkill(tmp_path: Path) -> None:
    p = launch(*STANDALONE, "--shutdown-timeout", "2", WORKER, str(tmp_path), "--sleep", "120", "--trap-term", "60")
    try:
        _wait_for(lambda: len(envs(tmp_path)) == 2)
        pids = _pids(envs(tmp_path))
        sent = time.monotonic()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - sent
        assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
        assert sorted(x.name for x in tmp_path.glob("*.sigterm")) == ["attempt0.rank0.sigterm", "attempt0.rank1.sigterm"]
        assert took >= 2.0, "workers get the grace period before SIGKILL"
        assert not any(_alive(x) for x in pids), "SIGTERM-ignoring workers were SIGKILLed"
    finally:
        p.kill()
        p.communicate()


def test_logs_per_attempt_are_kept(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    out = tmp_path / "out"
    out.mkdir()
    r = run(*STANDALONE, "--max-restarts", "1", "--log-dir", str(logs), "--redirects", "3",
            WORKER, str(out), "--fail", "0:0:exc")
    assert r.returncode == 0, r.stderr[-2000:]
    (run_dir,) = logs.iterdir()  # --standalone picks a fresh run id, as torchrun does
    first = run_dir / "attempt_0" / "0" / "stderr.log"
    assert "injected failure on rank 0" in first.read_text()
    assert (run_dir / "attempt_1" / "0" / "stdout.log").exists()
    assert json.loads((run_dir / "attempt_0" / "0" / "error.json").read_text())["message"]


def test_missing_script_is_a_usage_error(tmp_path: Path) -> None:
    r = run("--standalone", str(tmp_path / "nope.py"))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "nope.py" in r.stderr and "Traceback" not in r.stderr


PRELOAD_RUN = """
import json, sys
from elastictk.cli import parse_or_exit
from elastictk.agent import build_agent, start_preload
config = parse_or_exit(sys.argv[1:])
server = start_preload(config)
try:
    agent, handle = build_agent(config, preload_server=server)
    try:
        result = agent.run()
    finally:
        handle.close()
    import psutil
    print(json.dumps({"code": result.exit_code, "server": server.pid,
                      "server_alive": psutil.pid_exists(server.pid)}))
finally:
    server.close()
"""


def test_workers_fork_from_the_preload_server_the_launcher_started_first(tmp_path: Path) -> None:
    """``elastictk-run`` starts the fork server before it imports torch itself, so the two
    imports overlap; the agent must then fork from that server (not start a second one) and
    leave it to its owner."""
    script = tmp_path / "ppid.py"
    script.write_text("import os, sys\nopen(sys.argv[1], 'w').write(str(os.getppid()))\n")
    out = tmp_path / "ppid"
    p = subprocess.run([sys.executable, "-c", PRELOAD_RUN, "--standalone", "--nproc-per-node", "1",
                        "--log-dir", str(tmp_path / "logs"), str(script), str(out)],
                       cwd=ROOT, text=True, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    assert seen["code"] == 0 and seen["server_alive"]
    assert int(out.read_text()) == seen["server"]


@pytest.mark.parametrize("flags, preloads", [((), True), (("--start-method", "spawn"), False),
                                             (("--no-python",), False)])
def test_the_launcher_starts_a_preload_server_only_for_forked_python_workers(
        flags: tuple[str, ...], preloads: bool) -> None:
    from elastictk.cli import parse_or_exit
    from elastictk.agent import start_preload

    config = parse_or_exit(["--standalone", *flags, "/bin/true" if "--no-python" in flags else WORKER])
    server = start_preload(config)
    try:
        assert (server is not None) == preloads
    finally:
        if server is not None:
            server.close()


FILTER_WORKER = """
import os, sys, time
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"apple {rank} {attempt}", flush=True)
print(f"pear {rank} {attempt}", flush=True)
print(f"or,ange {rank} {attempt}", flush=True)
print(f"warn: apple {rank} {attempt}", file=sys.stderr, flush=True)
if attempt == "0":
    time.sleep(1.0 if rank == "0" else 30)  # rank 0 fails; rank 1 is stopped by the restart
    sys.exit(1)
"""


def _filtered(log_dir: Path) -> dict[str, list[str]]:
    return {f"{p.parent.name}/{p.name}": sorted(p.read_text().splitlines())
            for p in sorted(log_dir.glob("*/attempt_*/filtered_*.log"))}


def test_duplicate_filters_write_the_files_torchrun_writes(tmp_path: Path) -> None:
    """Per attempt, ``filtered_{stdout,stderr}.log`` hold the tee'd lines with a filter string,
    prefixed, from every rank: line for line what torchrun writes for the same flags."""
    script = tmp_path / "filters.py"
    script.write_text(FILTER_WORKER)
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--tee", "3",
             "--duplicate-stdout-filters", "apple,or,,ange", "--duplicate-stderr-filters", "warn"]
    r = run(*flags, "--start-method", "spawn", "--log-dir", str(tmp_path / "ours"), str(script))
    assert r.returncode == 0, r.stderr[-3000:]
    t = subprocess.run([sys.executable, "-m", "torch.distributed.run", *flags,
                        "--log-dir", str(tmp_path / "torch"), str(script)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert t.returncode == 0, t.stderr[-3000:]
    ours, theirs = _filtered(tmp_path / "ours"), _filtered(tmp_path / "torch")
    assert ours["attempt_1/filtered_stdout.log"] == [
        "[default0]:apple 0 1", "[default0]:or,ange 0 1",
        "[default1]:apple 1 1", "[default1]:or,ange 1 1"]
    assert ours == theirs

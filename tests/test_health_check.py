"""--health-check CMD: a node whose check fails stays out of the job (real commands, real jobs)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from elastictk.agent.health import check_settings, run_check
from elastictk.metrics.events import read_events

RUN = str(Path(sys.executable).parent / "elastictk-run")
BAD = 'echo checking; echo "GPU 0: 12 uncorrectable ECC errors" >&2; exit 3'


def test_run_check_keeps_the_last_line_and_the_exit() -> None:
    r = run_check(BAD, timeout=10)
    assert not r.ok and r.exit == "code 3" and r.line == "GPU 0: 12 uncorrectable ECC errors"
    assert run_check("true", timeout=10).ok


def test_a_check_that_hangs_is_killed_with_its_children(tmp_path: Path) -> None:
    pidfile = tmp_path / "child"
    t0 = time.monotonic()
    r = run_check(f"sleep 60 & echo $! > {pidfile}; echo waiting; wait", timeout=0.5)
    assert not r.ok and r.exit == "timed out after 0.5s" and r.line == "waiting"
    assert time.monotonic() - t0 < 55  # a hang guard only: the check itself would take 60 s
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the check's child outlived it"
        time.sleep(0.05)


@pytest.mark.parametrize("command,interval,msg", [
    ("  ", 60.0, "--health-check is empty"), (None, 0.0, "--health-interval 0.0 must be seconds > 0"),
])
def test_bad_settings_are_one_line(command: str | None, interval: float, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        check_settings(command, interval)


def _run(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "train.py").write_text("print('trained', flush=True)\n")
    return subprocess.run([RUN, "--standalone", "--nproc-per-node", "1", "--start-method", "spawn",
                           "--event-log", str(tmp_path / "events.jsonl"), *flags, "train.py"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_a_failing_node_stays_out_and_a_one_node_job_ends(tmp_path: Path) -> None:
    p = _run(tmp_path, "--rdzv-conf", "join_timeout=2", "--health-interval", "0.5", "--health-check", BAD)
    assert p.returncode == 1 and "trained" not in p.stdout, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("[elastictk-run] failed (exit 1): health check failed (code 3: GPU 0: 12 "
                           "uncorrectable ECC errors): this node stayed out for the join timeout (2s)"), last
    assert "health check failed (code 3): GPU 0: 12 uncorrectable ECC errors; this node stays out" in p.stderr
    events = read_events(tmp_path / "events.jsonl")
    failed = [e for e in events if e.kind == "health_check_failed"]
    assert len(failed) >= 2 and failed[0].fields["line"] == "GPU 0: 12 uncorrectable ECC errors"
    assert not any(e.kind in ("round_joined", "workers_started") for e in events)


def test_a_node_joins_once_its_check_passes(tmp_path: Path) -> None:
    check = "if [ -f seen ]; then exit 0; fi; touch seen; echo disk full; exit 1"
    p = _run(tmp_path, "--health-interval", "0.2", "--health-check", check)
    assert p.returncode == 0 and "trained" in p.stdout, p.stderr[-2000:]
    kinds = [e.kind for e in read_events(tmp_path / "events.jsonl")]
    assert kinds.count("health_check_failed") == 1
    assert kinds.index("health_check_failed") < kinds.index("round_joined")


def test_a_node_that_turns_bad_in_a_round_leaves(tmp_path: Path) -> None:
    """Checked every interval while training too: the workers are stopped, the failure is
    charged as a worker's would be, and the gate keeps the node out of the next round."""
    (tmp_path / "long.py").write_text("import time\ntime.sleep(600)\n")  # stopped, never finished
    check = "if [ -f seen ]; then echo 'GPU 1 fell off the bus'; exit 1; fi; touch seen"
    p = subprocess.run([RUN, "--standalone", "--nproc-per-node", "1", "--start-method", "spawn",
                        "--max-restarts", "3", "--rdzv-conf", "join_timeout=1", "--health-interval", "0.5",
                        "--event-log", str(tmp_path / "events.jsonl"), "--health-check", check, "long.py"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 1, p.stderr[-2000:]  # no time bound: the events below say who stopped them
    assert "health check failed (code 1): GPU 1 fell off the bus; this node leaves the job" in p.stderr
    kinds = [(e.kind, e.fields.get("reason")) for e in read_events(tmp_path / "events.jsonl")]
    i = kinds.index(("workers_stopped", "health_check_failed"))
    assert kinds[i - 1][0] == "health_check_failed" and kinds[i + 1][0] == "restart"
    assert "GPU 1 fell off the bus" in str(kinds[i + 1][1])


@pytest.mark.parametrize("flags", [["--health-check", ""], ["--health-check", "true", "--health-interval", "0"]])
def test_bad_flag_values_are_one_line(tmp_path: Path, flags: list[str]) -> None:
    p = subprocess.run([RUN, "--standalone", *flags, "train.py"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert "--health-" in p.stderr

"""``elastictk-run --recovery in-place`` end to end: real workers, real gloo, real signals.

The job is ``examples/train_inplace.py`` (deterministic: fixed seeds, samples by global index);
each worker appends a line per process-group formation (rank, pid, generation) to a record file.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INPLACE = str(ROOT / "examples" / "train_inplace.py")
PLAIN = str(ROOT / "examples" / "train.py")
WORKERS = 3
STEPS = 16


def launch(tmp: Path, tag: str, script: str, *args: str, max_restarts: int = 3,
           recovery: str = "in-place", env: dict[str, str] | None = None, nproc: int = WORKERS,
           ) -> tuple[int, str, list[dict[str, int]]]:
    """Run one job to its end; (exit code, merged output, formation records)."""
    work = tmp / tag
    work.mkdir()
    record = work / "record.jsonl"
    extra = ["--record", str(record)] if script == INPLACE else ["--ckpt-dir", str(work / "ckpt")]
    cmd = [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", str(max_restarts), "--recovery", recovery, "--log-dir", str(work / "logs"),
           script, "--steps", str(STEPS), "--step-time", "0.01", *extra, *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    out = proc.stdout + proc.stderr
    records = [json.loads(x) for x in record.read_text().splitlines()] if record.exists() else []
    return proc.returncode, out, records


def checksum(out: str) -> str:
    m = re.search(rf"final checksum (\w+) after {STEPS} steps", out)
    assert m, out[-3000:]
    return m.group(1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The fault-free run's final weights (checksum)."""
    code, out, records = launch(tmp_path_factory.mktemp("ref"), "ref", INPLACE)
    assert code == 0, out[-3000:]
    assert {r["gen"] for r in records} == {0}
    return checksum(out)


def pids_by_generation(records: list[dict[str, int]]) -> dict[int, dict[int, int]]:
    out: dict[int, dict[int, int]] = {}
    for r in records:
        out.setdefault(r["gen"], {})[r["rank"]] = r["pid"]
    return out


def test_k_in_place_recoveries_end_with_the_fault_free_weights_and_keep_survivors(
        tmp_path: Path, reference: str) -> None:
    code, out, records = launch(tmp_path, "crash", INPLACE, "--crash", "4:1", "--crash", "9:2:SIGSEGV")
    assert code == 0, out[-3000:]
    assert checksum(out) == reference, "rollback + state from a peer = the fault-free weights"
    gens = pids_by_generation(records)
    assert sorted(gens) == [0, 1, 2] and all(len(g) == WORKERS for g in gens.values())
    assert gens[1] == {**gens[0], 1: gens[1][1]} and gens[1][1] != gens[0][1], \
        "only rank 1's process is new after the first recovery"
    assert gens[2] == {**gens[1], 2: gens[2][2]} and gens[2][2] != gens[1][2]
    assert [r["restart_count"] for r in records if r["gen"] == 2] == [2] * WORKERS
    assert out.count("inplace_recovery ") == 2 and "inplace_fallback" not in out
    assert "workers_started" in out and out.count("workers_started") == 1, "nobody restarted"
    assert "job_finished restarts=2" in out


def test_a_hang_becomes_an_in_place_recovery(tmp_path: Path, reference: str) -> None:
    code, out, records = launch(tmp_path, "hang", INPLACE, "--crash", "5:2:SIGSTOP",
                                env={"ELASTICTK_COLLECTIVE_TIMEOUT": "3"})
    assert code == 0, out[-3000:]
    assert checksum(out) == reference
    assert re.search(r"worker_frozen local_rank=2 pid=\d+ action=SIGKILL", out), out[-3000:]
    gens = pids_by_generation(records)
    assert sorted(gens) == [0, 1]
    assert gens[1] == {**gens[0], 2: gens[1][2]} and gens[1][2] != gens[0][2]
    assert out.count("workers_started") == 1


def test_in_place_failures_spend_the_restart_budget(tmp_path: Path) -> None:
    code, out, _ = launch(tmp_path, "budget", INPLACE, "--crash", "3:0", "--crash", "6:1",
                          max_restarts=1)
    assert code == 1, out[-3000:]
    assert "restart budget spent: 2 failures > --max-restarts=1" in out
    assert "Traceback" not in out.split("elastictk-run] job_failed")[-1]


def test_a_plain_script_falls_back_to_restart_all(tmp_path: Path) -> None:
    """train.py exits when a peer dies instead of re-forming: the agent restarts everything,
    charging the failure once."""
    code, out, _ = launch(tmp_path, "plain", PLAIN, "--ckpt-every", "3", "--crash", "7:1")
    assert code == 0, out[-3000:]
    assert "inplace_fallback" in out and "restart restart_count=1" in out
    assert "job_finished restarts=1" in out
    assert re.search(r"final checksum \w+ after", out)


def test_two_agents_replace_a_rank_on_one_node_while_the_other_keeps_running(tmp_path: Path) -> None:
    """Two agents on loopback: the agent whose worker died replaces it and publishes the next
    generation; the other agent's workers re-form with it and neither agent restarts."""
    from elastictk.store import quiet_port

    ref_code, ref_out, _ = launch(tmp_path, "ref4", INPLACE, nproc=4)
    assert ref_code == 0, ref_out[-3000:]
    endpoint = f"127.0.0.1:{quiet_port()}"
    record = tmp_path / "record.jsonl"
    conf = "last_call_timeout=1,heartbeat_interval=0.2,heartbeat_timeout=5,join_timeout=60"
    agents = [subprocess.Popen(
        [sys.executable, "-m", "elastictk.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "inplace2",
         "--rdzv-conf", conf, "--max-restarts", "1", "--recovery", "in-place",
         "--log-dir", str(tmp_path / f"logs{i}"), INPLACE, "--steps", str(STEPS),
         "--step-time", "0.01", "--record", str(record), "--crash", "6:3"],
        cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}) for i in range(2)]
    try:
        outs = [a.communicate(timeout=240)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.communicate()
    assert [a.returncode for a in agents] == [0, 0], [o[-2000:] for o in outs]
    both = "".join(outs)
    assert checksum(both) == checksum(ref_out)
    assert both.count("inplace_recovery ") == 1 and both.count("workers_started") == 2
    gens = pids_by_generation([json.loads(x) for x in record.read_text().splitlines()])
    assert sorted(gens) == [0, 1]
    assert gens[1] == {**gens[0], 3: gens[1][3]} and gens[1][3] != gens[0][3]

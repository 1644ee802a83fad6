"""elastictk under a real Slurm 22.05: slurmctld and three slurmds on network-namespace hosts
(elastictk.testing.slurm), jobs submitted with sbatch, elastictk-run started by srun only.

One cluster for the module. Verdicts come from what the job recorded (the agents' event logs,
the notes examples/slurm/train.py writes, the disk tier) and from Slurm's own state (scontrol
show job / node), never from a job's output.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.agent.preempt import newest_complete_step
from elastictk.metrics.events import Event, read_events
from elastictk.testing.slurm import SlurmCluster, field, parse_show
from tests.helpers import slurm_cluster

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "helpers" / "slurm_train.sbatch"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    why = slurm_cluster.why_not()
    if why is not None:
        pytest.skip(f"no real Slurm cluster here: {why}")
    hosts, cluster = slurm_cluster.start(3, tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.close()
        hosts.close()


def submit(slurm: SlurmCluster, out: Path, nodes: int, nnodes: str, steps: int, *extra: str,
           health: str | None = None) -> str:
    out.mkdir(parents=True, exist_ok=True)
    env = {"OUT": str(out), "NNODES": nnodes, "STEPS": str(steps),
           "ETK_RUN": str(ROOT / ".venv" / "bin" / "elastictk-run"),
           "TRAIN": str(ROOT / "examples" / "slurm" / "train.py"),
           "ELASTICTK_RDZV_TOKEN": "t0ken-of-the-slurm-test", "PET_RDZV_CONF": "last_call_timeout=1",
           "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    if health is not None:
        env["HEALTH"] = health
    return slurm.sbatch([f"--nodes={nodes}", f"--output={out}/slurm-%j.out", *extra, str(SCRIPT)],
                        env=env, cwd=out)


def events(out: Path, node: str, run: int = 0) -> list[Event]:
    path = out / f"events-{node}-{run}.jsonl"
    return read_events(path) if path.exists() else []


def worlds(out: Path, node: str, run: int = 0) -> list[int]:
    return [e.get("world") for e in events(out, node, run) if e.kind == "round_joined"]


def stopped(out: Path) -> tuple[int, str]:
    """train.py's last note: the step rank 0 ended at and its weights' sum."""
    step, weights = (out / "train" / "stopped").read_text().split()
    return int(step), weights


def done(slurm: SlurmCluster, job: str, timeout: float = 120) -> dict[str, str]:
    return slurm.wait_job(job, ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"], timeout)


def job_output(out: Path) -> str:
    """The job's output (for a failure's message only: no verdict reads it)."""
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(out.glob("slurm-*.out")))


STEPS = 12


@pytest.fixture(scope="module")
def uninterrupted(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-node job that runs to its end: the weights every other run must reach."""
    out = tmp_path_factory.mktemp("whole")
    job = submit(slurm, out, 3, "3", STEPS)
    info = done(slurm, job)
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "n[1-3]", (info, job_output(out))
    return out


def test_a_three_node_job_trains_to_its_end(uninterrupted: Path) -> None:
    out = uninterrupted
    for node in ("n1", "n2", "n3"):
        kinds = [e.kind for e in events(out, node)]
        assert worlds(out, node) == [3] and "job_finished" in kinds, (node, kinds)
    assert stopped(out)[0] == STEPS and newest_complete_step(str(out / "ckpt")) == STEPS


@given(st.text(max_size=400) | st.binary(max_size=400).map(lambda b: b.decode("utf-8", "replace")),
       st.sampled_from(["JobState", "State", "Reason", "Restarts", "x"]))
@settings(max_examples=200, deadline=None)
def test_scontrol_output_of_any_shape_reads_as_plain_text(text: str, key: str) -> None:
    """parse_show/field read what scontrol printed: any text gives str keys and values, never
    an exception."""
    rec = parse_show(text)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in rec.items())
    value = field(text, key)
    assert value is None or isinstance(value, str)


def test_field_keeps_a_reason_with_spaces() -> None:
    line = "NodeName=n3 Arch=x86_64 State=IDLE+DRAIN Reason=elastictk: health check failed (1: no) [root@2026-11-26T23:00:00] Comment=(null)"
    assert field(line, "Reason") == "elastictk: health check failed (1: no) [root@2026-11-26T23:00:00]"
    assert parse_show(line)["State"] == "IDLE+DRAIN" and field(line, "Missing") is None

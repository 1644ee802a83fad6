"""elastictk under a real Slurm 22.05: slurmctld and three slurmds on network-namespace hosts
(elastictk.testing.slurm), jobs submitted with sbatch, elastictk-run started by srun only.

One cluster for the module. Verdicts come from what the job recorded (the agents' event logs,
the notes examples/slurm/train.py writes, the disk tier) and from Slurm's own state (scontrol
show job / node), never from a job's output.
"""
from __future__ import annotations

import math
import os
import signal
import time
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
pytestmark = pytest.mark.timeout(600)
#: How long a job may take to start and train (seconds): about 10 on an idle 2-core machine,
#: many times that when other test processes load it.
LOADED = 300


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    why = slurm_cluster.why_not()
    if why is not None:
        pytest.skip(f"no real Slurm cluster here: {why}")
    # n4 is the node the lost-node test kills: it stays down after (a slurmd restarted inside a
    # test would be a process the test leaves behind), the other tests run on n1-n3.
    hosts, cluster = slurm_cluster.start(4, tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.close()
        hosts.close()


def submit(slurm: SlurmCluster, out: Path, nodes: str, nnodes: str, steps: int, *extra: str,
           health: str | None = None) -> str:
    """sbatch the test job on ``nodes`` (a node list, ``n[1-3]``); its id."""
    out.mkdir(parents=True, exist_ok=True)
    env = {"OUT": str(out), "NNODES": nnodes, "STEPS": str(steps),
           "ETK_RUN": str(ROOT / ".venv" / "bin" / "elastictk-run"),
           "TRAIN": str(ROOT / "examples" / "slurm" / "train.py"),
           "ELASTICTK_RDZV_TOKEN": "t0ken-of-the-slurm-test", "PET_RDZV_CONF": "last_call_timeout=1",
           "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    if health is not None:
        env["HEALTH"] = health
    count = len(slurm.client(["scontrol", "show", "hostnames", nodes]).stdout.split())
    return slurm.sbatch([f"--nodes={count}", f"--nodelist={nodes}", f"--output={out}/slurm-%j.out",
                         *extra, str(SCRIPT)],
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


def done(slurm: SlurmCluster, job: str, timeout: float = LOADED) -> dict[str, str]:
    return slurm.wait_job(job, ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"], timeout)


def job_output(out: Path) -> str:
    """The job's output (for a failure's message only: no verdict reads it)."""
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(out.glob("slurm-*.out")))


STEPS = 40
WARNING = 60  # seconds: the job has this long to stop and requeue itself (sbatch --signal=USR1@60)


@pytest.fixture(scope="module")
def uninterrupted(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-node job that runs to its end: the weights every other run must reach."""
    out = tmp_path_factory.mktemp("whole")
    job = submit(slurm, out, "n[1-3]", "3", STEPS)
    info = done(slurm, job)
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "n[1-3]", (info, job_output(out))
    return out


def test_a_three_node_job_trains_to_its_end(uninterrupted: Path) -> None:
    out = uninterrupted
    for node in ("n1", "n2", "n3"):
        kinds = [e.kind for e in events(out, node)]
        assert worlds(out, node) == [3] and "job_finished" in kinds, (node, kinds)
    assert stopped(out)[0] == STEPS and newest_complete_step(str(out / "ckpt")) == STEPS


EXAMPLE = ROOT / "examples" / "slurm" / "train.sbatch"


def test_the_sbatch_example_submits_as_written(slurm: SlurmCluster, tmp_path: Path) -> None:
    """examples/slurm/train.sbatch itself, sbatch'ed from a directory like a fresh clone (the
    repository's examples/, no logs/): Slurm opens its output file there, every node's agent
    takes the job's defaults, the job trains to its end with the last step on disk, and each
    node's worker logs are in logs/<job>/<node>/. Only the node count is given on sbatch's
    command line (this cluster has fewer than the example's 5), and the knobs the script reads
    from the environment (a CPU-only cluster: NPROC=1)."""
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / "examples").symlink_to(ROOT / "examples")
    ckpt, steps = tmp_path / "ckpt", 10
    env = {"ELASTICTK_RDZV_TOKEN": "t0ken-of-the-example", "CKPT": str(ckpt), "NPROC": "1",
           "STEPS": str(steps), "PET_RDZV_CONF": "last_call_timeout=1",
           "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    job = slurm.sbatch(["--nodes=3", "--nodelist=n[1-3]", str(EXAMPLE)], env=env, cwd=clone)
    output = clone / f"elastic-train-{job}.out"
    try:
        info = done(slurm, job)
        said = output.read_text(errors="replace")[-4000:] if output.exists() else "(no output file)"
        assert info["JobState"] == "COMPLETED" and info["NodeList"] == "n[1-3]", (info, said)
        assert output.is_file(), sorted(p.name for p in clone.iterdir())
        assert newest_complete_step(str(ckpt)) == steps, said
        for node in ("n1", "n2", "n3"):
            logs = sorted((clone / "logs" / job / node).rglob("stdout.log"))
            assert logs and any(p.stat().st_size > 0 or (p.parent / "stderr.log").stat().st_size > 0
                                for p in logs), (node, logs, said)
    finally:
        slurm.client(["scancel", job], check=False)


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


def progress(out: Path) -> int:
    try:
        return int((out / "train" / "progress").read_text() or 0)
    except (OSError, ValueError):
        return 0


def wait_progress(out: Path, step: int, job: str, slurm: SlurmCluster, timeout: float = LOADED) -> None:
    """Until rank 0 committed ``step`` (train.py's note); the job's output in the failure."""
    deadline = time.monotonic() + timeout
    while progress(out) < step:
        assert time.monotonic() < deadline, (slurm.job_info(job), job_output(out))
        time.sleep(0.05)


def wait_events(out: Path, nodes: tuple[str, ...], kind: str, job: str, slurm: SlurmCluster,
                timeout: float = LOADED) -> None:
    """Until each of ``nodes``' agents recorded a ``kind`` event."""
    deadline = time.monotonic() + timeout
    while not all(kind in [e.kind for e in events(out, n)] for n in nodes):
        assert time.monotonic() < deadline, (slurm.job_info(job), job_output(out))
        time.sleep(0.1)


def test_scancel_usr1_preempts_the_job_which_is_requeued_and_resumes(
        slurm: SlurmCluster, uninterrupted: Path, tmp_path: Path) -> None:
    """scancel --signal=USR1: every agent stops as pre-empted, task 0 requeues the job
    (--requeue), the requeued run restores the disk tier's step and ends with the weights of
    the run never interrupted."""
    out = tmp_path / "preempted"
    job = submit(slurm, out, "n[1-3]", "3", STEPS)
    wait_progress(out, 2, job, slurm)
    t0 = time.monotonic()
    slurm.client(["scancel", "--signal=USR1", job])
    deadline = t0 + WARNING
    while slurm.job_info(job).get("Restarts") != "1":  # requeued by the job itself
        assert time.monotonic() < deadline, (slurm.job_info(job), job_output(out))
        time.sleep(0.1)
    for node in ("n1", "n2", "n3"):
        signalled = [e for e in events(out, node) if e.kind == "signalled"]
        assert [(e.get("signal"), e.get("preempted")) for e in signalled] == [("SIGUSR1", True)], node
    info = done(slurm, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, job_output(out))
    first, resumed = (out / "train" / "restored").read_text().split()
    assert first == "None" and 2 <= int(resumed) < STEPS, (first, resumed)
    assert stopped(out) == stopped(uninterrupted) and math.isfinite(float(stopped(out)[1])), job_output(out)
    assert worlds(out, "n1", run=1) == [3]


def agent_pids(slurm: SlurmCluster, node: str) -> list[int]:
    """The elastictk-run agent of the job step on ``node`` (its task: a process there whose
    command line runs elastictk-run)."""
    found = []
    for pid in slurm.pids_on(node):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"elastictk-run") for a in argv[:2]):
            found.append(pid)
    return found


def test_a_node_whose_slurmd_and_agent_die_leaves_the_job_to_the_others(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    """--nnodes 2:3 (sbatch and srun --no-kill) on n2-n4: n4's slurmd and agent SIGKILLed
    mid-job, n2 and n3 re-form as two and train to the end."""
    out = tmp_path / "lost"
    job = submit(slurm, out, "n[2-4]", "2:3", STEPS)
    try:
        wait_progress(out, 2, job, slurm)
        agents = agent_pids(slurm, "n4")
        assert len(agents) == 1, agents
        slurm.kill_node("n4")
        os.kill(agents[0], signal.SIGKILL)
        wait_events(out, ("n2", "n3"), "job_finished", job, slurm)
        for node in ("n2", "n3"):
            assert worlds(out, node)[:1] == [3] and worlds(out, node)[-1] == 2, (node, worlds(out, node))
        assert stopped(out)[0] == STEPS
    finally:
        slurm.client(["scancel", job], check=False)


def test_a_node_failing_its_health_check_is_drained_in_slurm(slurm: SlurmCluster, tmp_path: Path) -> None:
    """--slurm-drain with a --health-check that fails on n3: Slurm shows n3 DRAIN with
    elastictk's reason, and n1, n2 train to the end without it."""
    out = tmp_path / "drained"
    job = submit(slurm, out, "n[1-3]", "2:3", STEPS, health='test "$SLURMD_NODENAME" != n3')
    try:
        wait_progress(out, STEPS, job, slurm)
        deadline = time.monotonic() + 30
        while "DRAIN" not in slurm.node_info("n3").get("State", ""):
            assert time.monotonic() < deadline, (slurm.node_info("n3"), job_output(out))
            time.sleep(0.1)
        shown = slurm.client(["scontrol", "--oneliner", "show", "node", "n3"]).stdout
        assert (field(shown, "Reason") or "").startswith("elastictk: health check failed"), shown
        assert [e.kind for e in events(out, "n3")].count("health_check_failed") >= 1
        for node in ("n1", "n2"):
            assert worlds(out, node) == [2], (node, worlds(out, node))
        assert all("DRAIN" not in slurm.node_info(n).get("State", "") for n in ("n1", "n2"))
    finally:
        # n3's agent waits out --rdzv-conf join_timeout for its check to pass, even once the
        # others finished: the job ends only then, so it is cancelled here
        slurm.client(["scancel", job], check=False)
        slurm.client(["scontrol", "update", "NodeName=n3", "State=RESUME"], check=False)

"""What reaches ``scontrol``: one job id (digits) and one host name of this job's node list,
never a Slurm keyword (``NodeName=ALL`` is every node of the cluster) nor a list, inside a job
step and outside one (an sbatch batch step: ``SLURM_JOB_ID`` without ``SLURM_STEP_ID``).
A fake ``scontrol`` on PATH records every argument it was given."""
from __future__ import annotations

import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.slurm import SlurmEnvError, drain, job_id, requeue, this_node
from elastictk.slurm import scontrol as scontrol_mod
from tests.test_slurm_defaults import _free_job_id, slurm_env

ROOT = Path(__file__).resolve().parent.parent
BATCH = {"SLURM_STEP_ID": "-"}  # an sbatch batch step: no step id
ONE_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _fake(tmp_path: Path) -> tuple[Path, Path]:
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    exe = bin_dir / "scontrol"
    exe.write_text(f'#!/bin/sh\nfor a in "$@"; do echo "$a"; done >> {calls}\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return bin_dir, calls


def test_refused_names_and_ids_never_reach_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir, calls = _fake(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    for node in ("ALL", "all", "DEFAULT", "node[1-500],ALL", "node[1-500]", "a,b", "", "-x", "a b"):
        answer = drain(node, "bad")
        assert not answer.ok and "not asking Slurm to drain" in answer.line, (node, answer)
    for job in ("4242,4243,4244", "4242 4243", "", "0", "-1", "4242_1", "1" * 21):
        answer = requeue(job)
        assert not answer.ok and "not asking Slurm to requeue" in answer.line, (job, answer)
    assert not calls.exists(), calls.read_text()
    assert drain("node02", "bad").ok and requeue("4242").ok  # the failing side: these are asked
    args = calls.read_text().splitlines()
    assert args[:3] == ["update", "NodeName=node02", "State=DRAIN"] and args[-2:] == ["requeue", "4242"], args


@given(st.text(max_size=40), st.text(max_size=30))
@settings(max_examples=300, deadline=None)
def test_any_text_is_one_plain_host_and_one_plain_id_or_is_not_asked(node: str, job: str) -> None:
    asked: list[list[str]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scontrol_mod, "_run", lambda args, what, fix: asked.append(args)
                   or scontrol_mod.Answer(True, "asked"))
        drain(node, "r")
        requeue(job)
    for args in asked:
        if args[0] == "update":
            name = args[1].removeprefix("NodeName=")
            assert ONE_HOST.fullmatch(name) and name.lower() not in ("all", "default"), args
        else:
            assert args[0] == "requeue" and args[1].isdigit() and args[1].isascii(), args


@pytest.mark.parametrize("extra", [{}, BATCH], ids=["step", "batch-step"])
def test_environment_checks_in_a_step_and_in_a_batch_step(extra: dict[str, str]) -> None:
    env = slurm_env(**extra)
    assert (job_id(env), this_node(env)) == ("4242", "node02")
    for bad, says in ((dict(SLURMD_NODENAME="ALL"), "keyword"),
                      (dict(SLURMD_NODENAME="node[1-500],ALL"), "not one host name"),
                      (dict(SLURMD_NODENAME="node09"), "not a node of this job"),
                      (dict(SLURM_JOB_NODELIST="-"), "SLURM_JOB_NODELIST is not set")):
        with pytest.raises(SlurmEnvError, match=says):
            this_node(slurm_env(**extra, **bad))
    for raw in ("4242,4243,4244", "4242 ", "x"):
        with pytest.raises(SlurmEnvError, match="not one Slurm job id"):
            job_id(slurm_env(**extra, SLURM_JOB_ID=raw))


# Each row: flags, the environment's changes (a batch step unless SLURM_STEP_ID is given),
# what the one line names. elastictk-run exits 2 and the fake scontrol was asked nothing.
CASES = [
    (["--slurm-drain", "--health-check", "true"], dict(SLURMD_NODENAME="ALL"),
     ["--slurm-drain", "SLURMD_NODENAME='ALL'", "keyword"]),
    (["--slurm-drain", "--health-check", "true"], dict(SLURMD_NODENAME="node[1-500],ALL"),
     ["--slurm-drain", "not one host name"]),
    (["--slurm-drain", "--health-check", "true"], dict(SLURMD_NODENAME="node7"),
     ["--slurm-drain", "not a node of this job", "SLURM_JOB_NODELIST='localhost'"]),
    (["--requeue"], dict(SLURM_JOB_ID="4242,4243,4244"), ["--requeue", "SLURM_JOB_ID='4242,4243,4244'"]),
    (["--requeue"], dict(SLURM_JOB_ID="4242,4243", SLURM_STEP_ID="0"), ["SLURM_JOB_ID", "4242,4243"]),
    ([], dict(SLURM_JOB_NODELIST="a[1-" + "9" * 5000 + "]", SLURM_STEP_ID="0"),
     ["SLURM_JOB_NODELIST", "5000 digits"]),
]


@pytest.mark.parametrize("flags,extra,names", CASES, ids=[str(i) for i in range(len(CASES))])
def test_elastictk_run_refuses_in_one_line_and_asks_scontrol_nothing(
        tmp_path: Path, flags: list[str], extra: dict[str, str], names: list[str]) -> None:
    bin_dir, calls = _fake(tmp_path)
    script = tmp_path / "w.py"
    script.write_text("print('trained')\n")
    env = slurm_env(**{"SLURM_JOB_ID": _free_job_id(), "SLURM_NNODES": "1",
                       "SLURM_JOB_NODELIST": "localhost", "SLURMD_NODENAME": "localhost",
                       "SLURM_PROCID": "0", "PATH": f"{bin_dir}:/usr/bin:/bin", **BATCH, **extra})
    done = subprocess.run([sys.executable, "-m", "elastictk.run", *flags, str(script)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "trained" not in done.stdout, done.stderr[-2000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastictk-run: error: "), done.stderr[-2000:]
    assert all(n in lines[0] for n in names), (names, lines[0])
    assert not calls.exists() or "update" not in calls.read_text() and "requeue" not in calls.read_text()

"""--slurm-drain: a node whose health check fails (or that is excluded) is drained with
scontrol update; without scontrol (or without the right to drain) one line says so and the
job goes on. Real elastictk-run runs under a faked one-node Slurm job with a fake scontrol."""
from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.agent.slurm_drain import drain_on_exclusion
from elastictk.metrics.kinds import EventKind
from elastictk.slurm import Answer, drain_reason
from tests.test_slurm_defaults import _free_job_id, slurm_env

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path: Path, scontrol: str | None) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A job whose health check fails once, then passes: it goes on and ends 0."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    for tool in ("sh", "test", "touch", "echo"):  # what the check and the fake need, nothing more
        (bin_dir / tool).symlink_to(next(p for d in ("/usr/bin", "/bin") if (p := Path(d) / tool).exists()))
    if scontrol is not None:
        exe = bin_dir / "scontrol"
        exe.write_text(f'#!/bin/sh\nfor a in "$@"; do echo "$a"; done >> {calls}\n{scontrol}\n')
        exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    mark = tmp_path / "checked"
    check = f"test -e {mark} || {{ touch {mark}; echo 'GPU 0: ECC \"errors\"'; exit 3; }}"
    script = tmp_path / "w.py"
    script.write_text("print('trained')\n")
    env = slurm_env(SLURM_JOB_ID=_free_job_id(), SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost",
                    SLURMD_NODENAME="localhost", PATH=str(bin_dir))
    done = subprocess.run([sys.executable, "-m", "elastictk.run", "--slurm-drain", "--health-check", check,
                           "--health-interval", "0.2", str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    return done, calls


def test_a_failed_health_check_drains_the_node(tmp_path: Path) -> None:
    done, calls = _run(tmp_path, "exit 0")
    assert done.returncode == 0, done.stderr
    drains = [c for c in calls.read_text().split("\n\n") if "update" in c]
    args = calls.read_text().splitlines()
    i = args.index("update")
    assert args[i:i + 3] == ["update", "NodeName=localhost", "State=DRAIN"], args
    assert args[i + 3].startswith("Reason=elastictk: health check failed (code 3: GPU 0: ECC errors)"), args
    assert len(drains) == 1 and args.count("update") == 1, "one drain per agent"
    assert "--slurm-drain: asked Slurm to drain node localhost" in done.stderr


def test_without_scontrol_one_line_and_the_job_goes_on(tmp_path: Path) -> None:
    done, _ = _run(tmp_path, None)
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if "cannot drain node localhost" in ln]
    assert len(lines) == 1 and "scontrol is not on PATH" in lines[0], done.stderr


def test_without_the_right_to_drain_one_line_and_the_job_goes_on(tmp_path: Path) -> None:
    done, _ = _run(tmp_path, "echo 'slurm_update error: Invalid user id' >&2; exit 1")
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if "cannot drain node localhost" in ln]
    assert len(lines) == 1 and "Invalid user id" in lines[0] and "administrator" in lines[0], done.stderr


def test_an_exclusion_drains_once_and_other_events_do_not() -> None:
    asked: list[tuple[str, str]] = []
    seen: list[EventKind] = []
    emit = drain_on_exclusion("n7", lambda k, **f: seen.append(k),
                              ask=lambda n, r: asked.append((n, r)) or Answer(True, "ok"))
    emit(EventKind.WORKERS_STOPPED, reason="x")
    assert asked == []
    emit(EventKind.NODE_EXCLUDED, node_id="n7-1", reason="failures", detail="3 in 60s")
    emit(EventKind.HEALTH_CHECK_FAILED, exit="code 1", line="")
    assert asked == [("n7", "excluded (failures: 3 in 60s)")]
    assert seen == [EventKind.WORKERS_STOPPED, EventKind.NODE_EXCLUDED, EventKind.HEALTH_CHECK_FAILED]


@given(st.text(max_size=500))
@settings(max_examples=300, deadline=None)
def test_a_drain_reason_is_one_plain_bounded_argument(text: str) -> None:
    r = drain_reason(text)
    assert r.startswith("elastictk: ") and len(r) <= 200
    assert all(ch.isascii() and ch.isprintable() and ch not in "\"'`$\\" for ch in r)

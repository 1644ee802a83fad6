"""Pre-emption under a faked Slurm job (its variables, one node at 127.0.0.1): SIGUSR1 to
elastictk-run mid-job is forwarded, the workers end, the disk tier holds the newest step, the
agent exits 75 and a relaunch resumes from that step; --requeue asks a fake scontrol on PATH."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from elastictk.agent.preempt import PREEMPTED_EXIT, newest_complete_step
from elastictk.store import quiet_port
from tests.test_slurm_defaults import _free_job_id, slurm_env

ROOT = Path(__file__).resolve().parent.parent
HELPER = ROOT / "examples" / "slurm" / "train.py"


def _env(job: str, bin_dir: Path | None = None) -> dict[str, str]:
    """A one-node Slurm job's environment. The store's port is a free one (through the
    environment, as a flag would be): Slurm's default, torchrun's 29400, is also another test's
    loopback port, and two tests at once collided on it."""
    path = os.environ["PATH"] if bin_dir is None else f"{bin_dir}:{os.environ['PATH']}"
    return slurm_env(SLURM_JOB_ID=job, SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost",
                     SLURMD_NODENAME="localhost", SLURM_PROCID="0", PATH=path,
                     PET_RDZV_ENDPOINT=f"localhost:{quiet_port()}")


def _wait_for(path: Path, ok: Callable[[str], bool], proc: subprocess.Popen[str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and ok(path.read_text()):
            return
        if proc.poll() is not None:
            pytest.fail(f"elastictk-run ended early ({proc.returncode}): {proc.communicate()[1]}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"{path.name} never arrived: {proc.communicate()[1]}")


def _fake_scontrol(tmp_path: Path, code: int = 0) -> tuple[Path, Path]:
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol-calls"
    bin_dir.mkdir()
    exe = bin_dir / "scontrol"
    exe.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n'
                   + ("" if code == 0 else f"echo 'Access/permission denied' >&2\nexit {code}\n"))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return bin_dir, calls


def test_preempted_mid_job_the_newest_step_is_on_disk_and_a_relaunch_resumes(tmp_path: Path) -> None:
    job, out, snap = _free_job_id(), tmp_path / "out", tmp_path / "snap"
    out.mkdir()
    argv = [sys.executable, "-m", "elastictk.run", "--nproc-per-node", "2", "--snapshot", "local,disk",
            "--snapshot-dir", str(snap), "--snapshot-every", "1000", "--grace-period", "30", "--requeue",
            str(HELPER), "--out", str(out)]
    bin_dir, calls = _fake_scontrol(tmp_path)
    proc = subprocess.Popen(argv, cwd=ROOT, env=_env(job, bin_dir), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for(out / "progress", lambda t: t.strip().isdigit() and int(t) >= 3, proc)
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == PREEMPTED_EXIT, err
    stopped = int((out / "stopped").read_text().split()[0])
    assert stopped >= 3 and newest_complete_step(str(snap)) == stopped, err
    assert "pre-empted by SIGUSR1: 2 of 2 worker(s) ended within the grace period" in err, err
    assert calls.read_text().splitlines()[-1].split() == ["requeue", job], err
    # The requeued job: same job id, so it reads the steps the first run sealed.
    again = subprocess.run([*argv[:-3], str(HELPER), "--out", str(out), "--steps", str(stopped + 2)], cwd=ROOT,
                           env=_env(job), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert (out / "restored").read_text().split() == ["None", str(stopped)]
    resumed = (out / "stopped").read_text().split()
    # The same weights as a run never interrupted (a fresh job, no snapshot to restore).
    plain = tmp_path / "plain"
    plain.mkdir()
    whole = subprocess.run([sys.executable, "-m", "elastictk.run", "--nproc-per-node", "2", str(HELPER), "--out",
                            str(plain), "--steps", str(stopped + 2)], cwd=ROOT, env=_env(_free_job_id()),
                           capture_output=True, text=True, timeout=120)
    assert whole.returncode == 0, whole.stderr
    assert resumed == (plain / "stopped").read_text().split() and resumed[0] == str(stopped + 2)


def test_workers_that_ignore_the_warning_are_stopped_and_a_failed_requeue_is_one_line(tmp_path: Path) -> None:
    job = _free_job_id()
    started = tmp_path / "started"
    script = tmp_path / "w.py"
    script.write_text("import signal, time\nsignal.signal(signal.SIGUSR2, signal.SIG_IGN)\n"
                      f"open({str(started)!r}, 'w').close()\ntime.sleep(120)\n")
    bin_dir, calls = _fake_scontrol(tmp_path, code=1)
    proc = subprocess.Popen([sys.executable, "-m", "elastictk.run", "--requeue", "--preempt-signal", "USR2",
                             "--grace-period", "2", str(script)], cwd=ROOT, env=_env(job, bin_dir), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for(started, lambda _: True, proc)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGUSR2)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == PREEMPTED_EXIT and time.monotonic() - t0 < 30, err
    assert calls.read_text().splitlines()[-1].split() == ["requeue", job]
    assert "0 of 1 worker(s) ended within the grace period, the rest were stopped" in err, err
    lines = [ln for ln in err.splitlines() if "cannot requeue job" in ln]
    assert len(lines) == 1 and "permission denied" in lines[0], err


def test_without_requeue_a_preemption_asks_slurm_nothing(tmp_path: Path) -> None:
    """SIGUSR1 under Slurm without --requeue: exit 75, and the fake scontrol on PATH is never
    asked to requeue (every other pre-emption test passes --requeue)."""
    started = tmp_path / "started"
    script = tmp_path / "w.py"
    script.write_text(f"import time\nopen({str(started)!r}, 'w').close()\ntime.sleep(120)\n")
    bin_dir, calls = _fake_scontrol(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "elastictk.run", "--grace-period", "30", str(script)],
                            cwd=ROOT, env=_env(_free_job_id(), bin_dir), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for(started, lambda _: True, proc)
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == PREEMPTED_EXIT, err
    assert "pre-empted by SIGUSR1" in err, err
    asked = calls.read_text().splitlines() if calls.exists() else []  # "show hostnames" may be
    assert not [c for c in asked if c.startswith("requeue")], f"{asked}\n{err}"


def test_preempt_signal_flags() -> None:
    from elastictk.cli.args import main_for_test

    env = _env("5")
    code, err, config = main_for_test(["--preempt-signal", "off", "/bin/true"], env)
    assert config is not None and config.preempt_signal is None
    code, err, config = main_for_test(["--preempt-signal", "KILL", "/bin/true"], env)
    assert code == 2 and err.count("\n") == 1, err
    code, err, config = main_for_test(["--preempt-signal", "SIGCHLD", "/bin/true"], env)
    assert code == 2 and "give one of SIGUSR1" in err, err
    code, err, config = main_for_test(["--requeue", "--preempt-signal", "off", "/bin/true"], env)
    assert code == 2 and "--requeue" in err, err
    outside = {k: v for k, v in env.items() if not k.startswith("SLURM")}
    code, err, config = main_for_test(["--requeue", "--preempt-signal", "USR1", "/bin/true"], outside)
    assert code == 0 and "not a Slurm job" in err, err

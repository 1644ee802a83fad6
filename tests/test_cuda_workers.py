"""CUDA workers under elastictk-run: restart after a crash, nothing left on the GPU afterwards.

These need a GPU and are skipped without one (the rest of the suite covers the same paths on
CPU). What only a GPU can show: workers forked from the preload server may initialise CUDA
(the server imported torch but never touched CUDA, so the fork is safe), an NCCL process group
forms again after a restart, and a worker killed with its agent frees its GPU memory.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parent.parent

TRAIN = textwrap.dedent("""\
    import os, signal, sys, time
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)  # 256 MiB to see it freed
    t = torch.ones(1024, device=dev)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    for step in range(1, 6):
        dist.all_reduce(t)
        torch.cuda.synchronize()
        print(f"step {step} attempt {attempt} value {t[0].item():.0f}", flush=True)
        if step == 2 and attempt == 0 and sys.argv[1] == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if sys.argv[1] == "forever":
            open(sys.argv[2], "w").write(str(os.getpid()))
            time.sleep(600)
    dist.destroy_process_group()
    print("done", flush=True)
""")


def _gpu_pids() -> set[int]:
    """PIDs holding a CUDA context, from the driver (empty if nvidia-smi cannot tell)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {int(x) for x in out.split() if x.strip().isdigit()}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _launch(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    script = tmp_path / "train_cuda.py"
    script.write_text(TRAIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "gpu",
         "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"), str(script), *args],
        cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_crashed_cuda_worker_restarts_with_nccl_from_the_preload_server(tmp_path: Path) -> None:
    p = _launch(tmp_path, "crash")
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert "step 2 attempt 0" in out and "step 5 attempt 1" in out and "done" in out, out
    assert "restart restart_count=1" in err


def test_killing_the_agent_frees_the_gpu(tmp_path: Path) -> None:
    pidfile = tmp_path / "worker.pid"
    p = _launch(tmp_path, "forever", str(pidfile))
    try:
        deadline = time.monotonic() + 240
        while not pidfile.exists() or not pidfile.read_text():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.2)
        worker = int(pidfile.read_text())
        before = _gpu_pids()
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(worker), f"worker {worker} outlived its SIGKILLed agent"
        while worker in _gpu_pids() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert worker not in _gpu_pids(), f"GPU context of {worker} outlived its agent ({before})"
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()

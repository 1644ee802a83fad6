"""A process group destroyed under a live DDP model is held until the model is gone (no other
group is), and the holding is on in every worker forked from the preload server."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import gc
    from elastictk.supervisor import groupkeep
    groupkeep.install()
    import torch, torch.distributed as dist

    def group():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    group()
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
    print("no model", groupkeep.kept())
    group()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    model(torch.randn(2, 4)).sum().backward()
    dist.barrier()
    dist.destroy_process_group()  # the DDP tutorial's order: the model outlives its group
    print("model alive", groupkeep.kept())
    group()
    print("still alive", groupkeep.kept())
    del model
    gc.collect()
    dist.destroy_process_group()
    print("model gone", groupkeep.kept())
""")


def test_a_group_is_held_only_while_a_ddp_model_outlives_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICTK_", "PET_"))}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    got = dict(x.rsplit(" ", 1) for x in out.stdout.splitlines())
    assert got == {"no model": "0", "model alive": "1", "still alive": "1", "model gone": "0"}, out.stdout


PROBE = textwrap.dedent("""
    import torch.distributed as dist
    print("keeps", getattr(dist.destroy_process_group, "__elastictk_keeps_groups__", False))
""")


def test_forked_workers_keep_destroyed_groups(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICTK_", "PET_"))}
    out = subprocess.run([sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "1",
                          "--log-dir", str(tmp_path / "logs"), "probe.py"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "keeps True" in out.stdout, out.stdout + out.stderr[-2000:]

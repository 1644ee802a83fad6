"""The disk tier at a script's end: the newest commit is on disk, or the worker exits 1.

End to end, the ending the DDP tutorial teaches (``state.commit()`` then
``dist.destroy_process_group()``, no ``state.flush()``) under ``elastictk-run --snapshot
local,disk`` with 2 gloo ranks: the newest step on disk is complete, verifies on every rank's
share and loads as the final weights, with no temporary step directory left; at step 6 the
background write was running when the group went, at step 7 the commit was not due
(``--snapshot-every 3``) and is written at the end. The snapshot's own process group is
destroyed and dropped at ``destroy_process_group`` (not late in interpreter shutdown).

In one process (world size 1, a subprocess each: the hook and ``atexit`` change the process):
a script that never destroys its group gets the newest commit written at exit; an end write
that cannot complete (the directory turned unsafe) is one line and exit 1 from
``destroy_process_group``, and a group destroyed where elastictk cannot see it is one line
and exit 1 at exit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from elastictk.snapshot.dcp import DcpDisk
from elastictk.snapshot.ending import script_ends

ROOT = Path(__file__).resolve().parent.parent

JOB = r'''
import json, sys
import torch, torch.distributed as dist
from elastictk import State
from torch.distributed import distributed_c10d as c10d

steps, out = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
state = State(model=model, optimizer=opt, step=0)
state.restore()
while state.step < steps:
    opt.zero_grad()
    model(torch.ones(2, 64) * (state.step + rank)).pow(2).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    state.step += 1
    state.commit()
snap = state._snap
dist.destroy_process_group()
if rank == 0:
    torch.save(model.state_dict(), out + "/final.pt")
with open(out + f"/group{rank}.json", "w") as f:
    json.dump({"dropped": snap.disk._group is None, "registered": len(c10d._world.pg_map)}, f)
'''


@pytest.mark.parametrize("steps,kept", [(6, [3, 6]), (7, [6, 7])])
def test_a_script_ending_with_destroy_process_group_leaves_its_newest_step_on_disk(
        tmp_path: Path, steps: int, kept: list[int]) -> None:
    (tmp_path / "job.py").write_text(JOB)
    snaps = tmp_path / "snaps"
    cmd = [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "2",
           "--snapshot", "local,disk", "--snapshot-dir", str(snaps), "--snapshot-every", "3",
           "--log-dir", str(tmp_path / "logs"), str(tmp_path / "job.py"), str(steps), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "not written to disk" not in out and "not on disk" not in out, out[-3000:]
    assert sorted(p.name for p in snaps.iterdir()) == [f"step-{s:010d}" for s in kept], out[-3000:]
    newest = kept[-1]
    assert DcpDisk(str(snaps), 0, 2).complete_steps() == sorted(kept, reverse=True)
    assert [DcpDisk(str(snaps), r, 2).verify(newest) for r in (0, 1)] == [None, None]
    back = DcpDisk(str(snaps), 0, 1).load(newest, None)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert back["values"]["step"] == newest
    assert final.keys() == back["objects"]["model"].keys()
    assert all(torch.equal(final[k], back["objects"]["model"][k]) for k in final)
    for r in (0, 1):  # the snapshot group went with the default group, not at interpreter exit
        assert json.loads((tmp_path / f"group{r}.json").read_text()) == {"dropped": True, "registered": 0}


ALONE = r'''
import os, sys
import torch, torch.distributed as dist
from elastictk import State

how, d = sys.argv[1], sys.argv[2]
destroy = dist.destroy_process_group  # bound before elastictk hooks it: a destroy it cannot see
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = torch.nn.Linear(4, 2)
state = State(model=model, step=0, snapshot_dir=d, snapshot_every=3)
while state.step < 4:
    state.step += 1
    state.commit()
if how == "unsafe":
    os.chmod(d, 0o777)  # the directory turns writable by others: refused
    dist.destroy_process_group()
elif how == "unseen":
    destroy()
print("script done", flush=True)
'''


def alone(tmp: Path, how: str) -> subprocess.CompletedProcess[str]:
    (tmp / "alone.py").write_text(ALONE)
    return subprocess.run([sys.executable, str(tmp / "alone.py"), how, str(tmp / "snaps")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RANK": "0", "WORLD_SIZE": "1"})


def steps_on_disk(tmp: Path) -> list[int]:
    return DcpDisk(str(tmp / "snaps"), 0, 1).complete_steps()


def test_a_script_that_never_destroys_its_group_gets_the_newest_commit_written_at_exit(
        tmp_path: Path) -> None:
    proc = alone(tmp_path, "keep")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert steps_on_disk(tmp_path) == [4, 3]  # 4 was not due (every 3): written at exit


def test_an_end_write_that_cannot_complete_is_one_line_and_exit_1(tmp_path: Path) -> None:
    proc = alone(tmp_path, "unsafe")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "script done" not in proc.stdout
    lines = [x for x in proc.stderr.splitlines() if "not on disk" in x]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("elastictk snapshot: rank 0: the newest commit, step 4, is not on disk (")
    assert "refused" in lines[0] and "the newest step this rank wrote there is step 3; exiting 1" in lines[0]
    os.chmod(tmp_path / "snaps", 0o700)


def test_a_group_destroyed_where_elastictk_cannot_see_it_is_one_line_and_exit_1(tmp_path: Path) -> None:
    proc = alone(tmp_path, "unseen")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "script done" in proc.stdout and "Traceback" not in proc.stderr
    lines = [x for x in proc.stderr.splitlines() if "not on disk" in x]
    assert lines == ["elastictk snapshot: rank 0: the newest commit, step 4, is not on disk (the "
                     "process group was destroyed before it could be written); the newest step "
                     "this rank wrote there is step 3; exiting 1; call state.flush() before "
                     "destroying the process group"], proc.stderr
    assert steps_on_disk(tmp_path) == [3]


def _chain(*callers: tuple[str, str]) -> bool:
    """script_ends() seen from a call chain, outermost first: ``(module, function)`` each
    calling the next directly, the last calling it as the destroy wrapper does (its caller's
    frame)."""
    def probe() -> bool:
        return script_ends(sys._getframe(2))  # probe <- the wrapper <- the wrapper's caller

    inner: Callable[[], bool] = probe
    for module, name in reversed([*callers, ("elastictk.snapshot.ending", "destroy_process_group")]):
        g: dict[str, Any] = {"__name__": module, "inner": inner}
        exec(f"def {name}():\n    return inner()\n", g)  # noqa: S102 - a frame of that module and name
        inner = g[name]
    return bool(inner())


def test_only_the_scripts_own_destroy_and_run_elastics_finished_close_end_the_script() -> None:
    """run_elastic's teardown at a failure or re-forming must not write (a collective while a
    peer may be gone could hang); its close after the loop, and any script's call, must."""
    session = "elastictk.inplace.session"
    assert _chain(("__main__", "main"))
    assert not _chain((session, "leave"), (session, "_teardown"))
    assert _chain((session, "close"), (session, "_teardown"))
    # another wrapper of destroy_process_group in between (groupkeep's): its caller decides
    assert not _chain((session, "_teardown"), ("elastictk.supervisor.groupkeep", "destroy_process_group"))
    assert _chain(("__main__", "main"), ("elastictk.supervisor.groupkeep", "destroy_process_group"))
    try:
        raise RuntimeError("a collective failed")
    except RuntimeError:  # close on the way out of an error: not the end of training
        assert not _chain((session, "close"), (session, "_teardown"))

"""Hot standby workers for in-place recovery: the preload server keeps one process forked and
warmed ahead of need, and a replacement *is* that process (its pid), with a worker's whole
world: environment, streams, title, session, death watch. It never counts as a worker and
never outlives the job.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator, Optional

import psutil
import pytest

from elastictk.supervisor.env import Assignment
from elastictk.supervisor.forkserver import PreloadServer
from tests.helpers.unformed import unformed_reports
from elastictk.supervisor.forkwarm import script_imports
from elastictk.supervisor.group import WorkerGroup
from elastictk.supervisor.spec import Std, WorkerSpec, python_script_argv

# A worker that reports what it sees; rank 1's first process exits 3 (a failure to replace).
# ``fractions`` is imported at the top level (an installed module: the standby imports it
# ahead), ``localmod`` next to the script (the user's own: never imported ahead).
WORKER = """\
import json, os, sys
ahead = {m: m in sys.modules for m in ("fractions", "localmod")}
import fractions  # noqa: F401
import localmod  # noqa: F401
p = "/proc/self/"
out = {"pid": os.getpid(), "env": dict(os.environ), "ahead": ahead, "argv": sys.argv,
       "sid": os.getsid(0), "cwd": os.getcwd(),
       "cmdline": open(p + "cmdline").read().split("\\0")[:-1], "comm": open(p + "comm").read().strip()}
print("hello from", os.environ["RANK"], flush=True)
with open(os.path.join(os.environ["OUT_DIR"], f"{os.getpid()}.json"), "w") as f:
    json.dump(out, f)
if os.environ["LOCAL_RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)
"""


@pytest.fixture(scope="module")
def server() -> Iterator[PreloadServer]:
    """A preload server that preloads something small (torch would cost seconds)."""
    with PreloadServer(preload=["decimal", "json"]) as s:
        yield s


def assignment() -> Assignment:
    return Assignment.homogeneous(1, 2, 2, master_addr="127.0.0.1", master_port=29512,
                                  run_id="job", max_restarts=3)


def wait_standby(server: PreloadServer, other_than: Optional[int] = None, timeout: float = 30) -> int:
    """The server's standby once it is waiting (its title set)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = server.standby_pid()
        if pid is not None and pid != other_than:
            try:
                if psutil.Process(pid).name() == "et-standby":
                    return pid
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.05)
    raise AssertionError(f"no standby within {timeout}s")


def report(out: Path, pid: int) -> dict:
    return json.loads((out / f"{pid}.json").read_text())


def group_with_failure(tmp_path: Path, server: PreloadServer) -> tuple[WorkerGroup, Path, dict]:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "localmod.py").write_text("X = 1\n")
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    spec = WorkerSpec(python_script_argv(str(path), "--flag", "v"), local_world_size=2,
                      start_method="preload", env={"OUT_DIR": str(out)}, redirects=Std.ALL)
    g = WorkerGroup(spec, tmp_path / "logs", preload_server=server)
    g.start(0, assignment())
    first = {lr: r.exitcode for lr, r in g.wait(timeout=60).items()}
    return g, out, first


def test_a_replacement_is_the_standby_with_a_workers_whole_world(tmp_path: Path,
                                                                 server: PreloadServer) -> None:
    g, out, first = group_with_failure(tmp_path, server)
    try:
        assert first == {0: 0, 1: 3}
        old = report(out, g.replaced[0].pid if g.replaced else g.results[1].pid)
        assert g.keep_standby()
        standby = wait_standby(server)
        proc = psutil.Process(standby)
        assert proc.ppid() == server.pid and standby not in g.pids().values()
        assert proc.name() == "et-standby" and "standby worker" in " ".join(proc.cmdline())
        assert os.getsid(standby) == standby  # its own session already

        pid = g.respawn(1, 1, "gen_1")
        assert pid == standby and g.from_standby == [standby]
        assert g.wait(timeout=60)[1].exitcode == 0
        new = report(out, pid)
        # Everything a worker sees is that rank's, as a fresh fork would have it: only the
        # restart count and the error file (under gen_1/) differ from the first process.
        changed = {k for k in set(old["env"]) | set(new["env"]) if old["env"].get(k) != new["env"].get(k)}
        assert changed == {"TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE"}
        assert (new["env"]["RANK"], new["env"]["LOCAL_RANK"], new["env"]["TORCHELASTIC_RESTART_COUNT"]) \
            == ("3", "1", "1")
        assert "gen_1" in new["env"]["TORCHELASTIC_ERROR_FILE"]
        for k in ("argv", "cwd", "cmdline", "comm"):
            assert new[k] == old[k], k
        assert new["comm"] == "worker.py" and new["sid"] == pid
        # Prewarmed: the installed module yes, the script's own module no.
        assert new["ahead"] == {"fractions": True, "localmod": False}
        assert old["ahead"] == {"fractions": False, "localmod": False}
        assert g.attempt_dir is not None
        logs = list((g.attempt_dir / "gen_1" / "1").glob("stdout*"))
        assert logs and "hello from 3" in logs[0].read_text()

        # A new standby is forked once the server is quiet again.
        again = wait_standby(server, other_than=standby)
        assert again not in g.pids().values()
    finally:
        g.close()
    # The job's end takes the standby with it (a shared server: the group drops it).
    assert not psutil.pid_exists(again) or psutil.Process(again).status() == psutil.STATUS_ZOMBIE
    assert server.standby_pid() is None
    assert [c.pid for c in psutil.Process(server.pid).children()] == []


def test_without_a_standby_a_replacement_is_a_fresh_fork(tmp_path: Path, server: PreloadServer) -> None:
    g, out, _ = group_with_failure(tmp_path, server)
    try:
        pid = g.respawn(1, 1, "gen_1")
        assert g.from_standby == [] and server.standby_pid() is None
        assert g.wait(timeout=60)[1].exitcode == 0
        assert report(out, pid)["ahead"]["fractions"] is False
    finally:
        g.close()


def test_the_standby_dies_with_the_server(tmp_path: Path) -> None:
    s = PreloadServer(preload=["json"])
    s.start()
    try:
        s.keep_standby({"cwd": str(tmp_path)}, delay=0)
        standby = wait_standby(s)
        proc = psutil.Process(standby)
    finally:
        s.close()
    proc.wait(timeout=10)  # raises TimeoutExpired if it outlived its server


def test_script_imports_reads_the_top_level() -> None:
    src = ("import a.b, c\nfrom d.e import f\nfrom . import g\ntry:\n    import h\nexcept ImportError:\n"
           "    pass\nif True:\n    import i\ndef fn():\n    import j\n")
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"etk-imports-{os.getpid()}.py"
    path.write_text(src)
    try:
        assert script_imports(str(path)) == ["a.b", "c", "d.e", "h", "i"]
    finally:
        path.unlink()
    assert script_imports("/nonexistent/script.py") == []


# -- end to end: elastictk-run --recovery in-place ------------------------------------------------

JOB = """\
import json, os, signal, sys, time
import psutil
import torch
import torch.distributed as dist
from elastictk.inplace import State, run_elastic

OUT = sys.argv[1]
model = torch.nn.Linear(2, 1)
state = State(model=model, step=0)
first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
        "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def standby():
    # the preload server's other child, titled as a standby; waits for it (forked after 0.5 s)
    for _ in range(400):
        kids = [p for p in psutil.Process(os.getppid()).children() if p.name() == "et-standby"]
        if kids:
            return kids[0].pid
        time.sleep(0.05)
    return None


def note(**kw):
    with open(OUT, "a") as f:
        f.write(json.dumps(kw) + "\\n")


def on_join(state, ctx):
    note(what="join", gen=ctx.generation, rank=ctx.rank, pid=os.getpid(),
         env={k: os.environ.get(k) for k in KEYS}, comm=open("/proc/self/comm").read().strip())


def step(state, ctx):
    if first and ctx.rank == 1 and state.step == 2:
        note(what="standby", pid=standby() if os.environ["WANT_STANDBY"] == "1" else None)
        os.kill(os.getpid(), signal.SIGKILL)
    for p in model.parameters():
        dist.all_reduce(p.data)
    state.step += 1


run_elastic(state, step, steps=4, on_join=on_join)
if int(os.environ["RANK"]) == 0 and os.environ["WANT_STANDBY"] == "1":
    note(what="refilled", pid=standby())
"""


def run_job(tmp_path: Path, standby: str) -> tuple[int, str, list[dict]]:
    import subprocess
    import sys

    job = tmp_path / "job.py"
    job.write_text(JOB)
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--recovery", "in-place", "--standby", standby,
           "--log-dir", str(tmp_path / "logs"), str(job), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "WANT_STANDBY": standby})
    notes = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    # A generation that never formed: where each worker was, at the failure output's tail.
    return proc.returncode, proc.stdout + proc.stderr + unformed_reports(tmp_path / "logs"), notes


def test_in_place_recovery_resumes_on_the_standby_and_the_job_leaves_none(tmp_path: Path) -> None:
    code, out, notes = run_job(tmp_path, "1")
    assert code == 0, out[-3000:]
    standby = [n["pid"] for n in notes if n["what"] == "standby"]
    refilled = [n["pid"] for n in notes if n["what"] == "refilled"]
    joins = {(n["gen"], n["rank"]): n for n in notes if n["what"] == "join"}
    assert standby and standby[0] is not None, out[-3000:]
    assert (1, 1) in joins, f"joins (generation, rank): {sorted(joins)}\n{out[-3000:]}"
    new = joins[(1, 1)]
    assert new["pid"] == standby[0], "the replacement is the standby process"
    assert joins[(1, 0)]["pid"] == joins[(0, 0)]["pid"] != new["pid"]
    assert new["env"] == {**joins[(0, 1)]["env"], "TORCHELASTIC_RESTART_COUNT": "1"}
    assert (new["env"]["RANK"], new["env"]["LOCAL_RANK"], new["env"]["WORLD_SIZE"]) == ("1", "1", "2")
    assert new["comm"] == "job.py"
    assert "inplace_recovery" in out and "standby=[1]" in out, out[-3000:]
    # The job is over: neither the promoted standby's successor nor anything else is left.
    assert refilled and refilled[0] not in (None, standby[0])
    for pid in (standby[0], refilled[0]):
        assert not psutil.pid_exists(pid), f"pid {pid} outlived the job"


def test_standby_0_replaces_with_a_fresh_fork(tmp_path: Path) -> None:
    code, out, notes = run_job(tmp_path, "0")
    assert code == 0, out[-3000:]
    assert "standby=[]" in out and "et-standby" not in out, out[-3000:]
    joins = {(n["gen"], n["rank"]): n for n in notes if n["what"] == "join"}
    assert joins[(1, 1)]["pid"] != joins[(0, 1)]["pid"]
    assert joins[(1, 1)]["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"

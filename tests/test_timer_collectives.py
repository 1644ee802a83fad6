"""Collective timeouts without touching the training script, end to end.

The centrepiece is a real gloo job of three workers started by a real ``WorkerGroup`` with the
environment a ``TimerServer`` asks for: one rank freezes (SIGSTOP) mid-training, the other two
hang in ``all_reduce`` (one synchronously, one in ``Work.wait()`` of an async op), their
collective timers fire, the reaper dumps and kills them, and the group sees the kills. The
group then restarts (the same regions, reset, serve the new workers) and the job finishes.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from elastictk.store import quiet_port
from elastictk.supervisor.env import Assignment
from elastictk.supervisor.group import WorkerGroup
from elastictk.supervisor.spec import Std, WorkerSpec, python_script_argv
from elastictk.timer import SITE_DIR, TimerServer

TRAIN = textwrap.dedent("""\
    import datetime, os, signal
    import torch
    import torch.distributed as dist

    def main():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        rank = dist.get_rank()
        t = torch.ones(8)
        dist.all_reduce(t)  # every rank gets here: a healthy step
        if rank == 2 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            os.kill(os.getpid(), signal.SIGSTOP)  # a frozen peer, in the first attempt only
        if rank == 1:
            work = dist.all_reduce(t, async_op=True)
            work.wait()  # RANK 1 STUCK
        else:
            dist.all_reduce(t)  # RANK 0 STUCK
        print("finished", t[0].item(), flush=True)
        dist.destroy_process_group()  # exiting with gloo's threads still up can abort

    main()
""")


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(TRAIN.splitlines(), 1) if marker in text)


def test_a_frozen_peer_gets_the_ranks_stuck_in_collectives_dumped_killed_and_restarted(
        tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    server = TimerServer(3)
    spec = WorkerSpec(python_script_argv(str(script)), local_world_size=3, redirects=Std.ALL,
                      grace_period=1.0, env=server.worker_env(collective_timeout=4.0))
    group = WorkerGroup(spec, tmp_path / "logs")
    try:
        assignment = Assignment.homogeneous(0, 1, 3, master_addr="127.0.0.1",
                                            master_port=quiet_port(), run_id="hang")
        group.start(0, assignment)
        server.watch(group.pids(), ranks={lr: assignment.global_rank(lr) for lr in range(3)},
                     report_dir=group.attempt_dir)
        exited = {}
        while len(exited) < 2:
            results = group.wait_any(timeout=120)
            assert results, "no worker exited within 120 s"
            exited.update({r.local_rank: r for r in results})
        assert set(exited) == {0, 1}, {lr: r.describe() for lr, r in exited.items()}
        assert all(r.exitcode == -signal.SIGKILL for r in exited.values())
        expiries = {e.local_rank: e for e in server.expiries()}
        assert set(expiries) == {0, 1}
        assert expiries[0].scope == "all_reduce"
        assert expiries[0].where == f"train.py:{_line('RANK 0 STUCK')} (main)"
        assert expiries[1].scope == "wait(allreduce)"
        assert expiries[1].where == f"train.py:{_line('RANK 1 STUCK')} (main)"
        assert "distributed_c10d.py" in expiries[0].stacks  # the dump came from inside torch
        for lr, e in expiries.items():
            assert e.pid == group.pids()[lr]
            report = group.attempt_dir / str(lr) / "timer_expired.txt"  # type: ignore[operator]
            assert e.report_path == str(report) and e.headline() in report.read_text()

        # What an agent does next: stop the attempt, reset the timers, restart, re-watch.
        group.stop(grace=1.0)  # SIGKILLs the frozen rank, which had no timer running
        assert server.stats["killed"] == 2
        server.unwatch()
        again = Assignment.homogeneous(0, 1, 3, master_addr="127.0.0.1", master_port=quiet_port(),
                                       run_id="hang", restart_count=1)
        group.start(1, again)
        server.watch(group.pids(), report_dir=group.attempt_dir)
        results = group.wait(timeout=120)
        assert {lr: r.exitcode for lr, r in results.items()} == {0: 0, 1: 0, 2: 0}, [
            (tmp_path / "logs" / "hang" / "attempt_1" / str(lr) / "stderr.log").read_text()
            for lr in range(3)]
        for lr in range(3):
            out = group.attempt_dir / str(lr) / "stdout.log"  # type: ignore[operator]
            assert "finished" in out.read_text()
        assert server.expiries() == [] and server.stats["killed"] == 2
    finally:
        group.stop(grace=1.0)
        server.unwatch()
        group.close()
        server.close()


def _python(code: str, env: dict[str, str],
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, text=True,
                          capture_output=True, timeout=timeout)


def test_watching_before_torch_is_imported_patches_it_on_import() -> None:
    proc = _python("""
        import sys
        from elastictk import timer
        timer.watch_collectives(30)
        print("torch" in sys.modules)
        import torch.distributed as dist
        from torch.distributed import all_reduce, isend
        c10d = dist.distributed_c10d
        timed = lambda f: hasattr(f, "__elastictk_untimed__")
        print(timed(all_reduce), timed(isend), c10d.all_reduce is all_reduce,
              timed(c10d.Work.wait), c10d.__loader__.__class__.__name__)
        timer.watch_collectives(10)  # again, torch loaded: re-wrapped in place
        print(timed(dist.all_reduce), dist.all_reduce is not all_reduce)
        timer.unwatch_collectives()
        print(timed(dist.all_reduce), timed(c10d.Work.wait), dist.all_reduce is c10d.all_reduce)
    """, dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:4] == [
        "False", "True True True True SourceFileLoader", "True True", "False False True"]


def test_the_site_hook_activates_and_still_runs_the_users_sitecustomize(tmp_path: Path) -> None:
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = 'yes'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SITE_DIR, str(user)]),
           "ELASTICTK_COLLECTIVE_TIMEOUT": "7"}
    code = """
        import os, sys
        from elastictk.timer import watching, SITE_DIR
        print(watching(), os.environ.get("USER_SITE_RAN"), "torch" in sys.modules,
              any(os.path.realpath(p) == SITE_DIR for p in sys.path if p))
    """
    proc = _python(code, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "7.0 yes False False"

    proc = _python(code, {**env, "ELASTICTK_COLLECTIVE_TIMEOUT": "soon"})
    assert proc.returncode == 0
    assert proc.stdout.strip() == "None yes False False"
    err = proc.stderr.strip()
    assert err.count("\n") == 0 and "ELASTICTK_COLLECTIVE_TIMEOUT='soon'" in err

"""A minimal agent for the tests that SIGKILL an agent: starts a worker group whose workers
start grandchildren, writes the helper pids, then blocks waiting on the group.

usage: python supervisor_agent.py <start_method> <log_dir> <pid_dir>
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from elastictk.supervisor.env import Assignment
from elastictk.supervisor.forkserver import PreloadServer
from elastictk.supervisor.group import WorkerGroup
from elastictk.supervisor.spec import WorkerSpec, python_script_argv
from tests.helpers.supervisor_workers import TREE_SCRIPT, run_tree


def main() -> None:
    method, log_dir, pid_dir = sys.argv[1:4]
    if method == "spawn":
        spec = WorkerSpec(run_tree, args=(pid_dir,), local_world_size=2, start_method="spawn")
    else:
        script = Path(pid_dir, "tree.py")
        script.write_text(TREE_SCRIPT)
        spec = WorkerSpec(python_script_argv(str(script), pid_dir), local_world_size=2,
                          start_method=method)
    server = PreloadServer(preload=["json"]) if method == "preload" else None
    group = WorkerGroup(spec, log_dir, preload_server=server)
    group.start(0, Assignment.homogeneous(0, 1, 2, master_addr="127.0.0.1", master_port=29500,
                                          run_id="agent-kill"))
    helpers = [group.death_watch_pid, server.pid if server else None]
    Path(pid_dir, "helpers").write_text(" ".join(str(p) for p in helpers if p))
    print("started", flush=True)
    group.wait_any(None)  # blocks until the test SIGKILLs this process
    os._exit(1)


if __name__ == "__main__":
    main()

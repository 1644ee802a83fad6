"""The rendezvous token stays with the agent: no worker gets it in its environment, and the
launcher never prints it (a real elastictk-run job, token from ELASTICTK_RDZV_TOKEN)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from elastictk.supervisor.env import WITHHELD, Assignment, worker_env

ROOT = Path(__file__).resolve().parent.parent
SECRET = "tok-3f9a1c-never-shown"

WORKER = """
import json, os, sys
with open(sys.argv[1], "w") as f:
    json.dump(dict(os.environ), f)
"""


def test_worker_env_withholds_the_token_from_the_agent_env_and_from_the_spec() -> None:
    a = Assignment.homogeneous(0, 1, 1, master_addr="127.0.0.1", master_port=1, run_id="j",
                               max_restarts=0)
    env = worker_env(a, role="r", local_rank=0, local_world_size=1, error_file=None,
                     base_env={"ELASTICTK_RDZV_TOKEN": SECRET, "KEEP": "1"},
                     extra={"ELASTICTK_RDZV_TOKEN": SECRET})
    assert env["KEEP"] == "1"
    assert not WITHHELD & set(env) and SECRET not in env.values()


def test_a_real_job_with_a_token_shows_it_to_no_worker_and_prints_it_nowhere(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    out = tmp_path / "env.json"
    env = {**os.environ, "ELASTICTK_RDZV_TOKEN": SECRET, "ELASTICTK_LOG_LEVEL": "DEBUG"}
    proc = subprocess.run(
        [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "1",
         "--log-dir", str(tmp_path / "logs"), str(script), str(out)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(out.read_text())
    assert "RANK" in seen, "the worker did not run under the launcher"
    assert SECRET not in json.dumps(seen)
    assert SECRET not in proc.stdout + proc.stderr
    for path in (tmp_path / "logs").rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(errors="replace"), path

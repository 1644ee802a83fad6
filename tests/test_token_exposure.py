"""The rendezvous token stays with the agent: no worker gets it in its environment, and the
launcher never prints it (a real elastictk-run job, token from ELASTICTK_RDZV_TOKEN)."""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

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


PROBE = ROOT / "tests" / "helpers" / "token_probe.py"


@pytest.mark.parametrize("given", ["env", "flag"])
def test_a_preloaded_worker_holds_no_copy_of_the_token(tmp_path: Path, given: str) -> None:
    """Workers fork from the preload server, itself forked from the launcher after its flags
    were parsed: the launcher's LaunchConfig, argv and environment were inherited. The worker
    looks through its objects, its frames and its environment block; for a token from the
    environment also through all its anonymous memory (a token on the command line has C
    copies of argv, which ``ps`` shows anyway: docs/security.md)."""
    token = "tk" + secrets.token_hex(16)
    out = tmp_path / "found.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTICTK_"))}
    flag: list[str] = []
    if given == "env":
        env["ELASTICTK_RDZV_TOKEN"] = token
    else:
        flag = ["--rdzv-token", token]
    proc = subprocess.run(
        [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "1", *flag,
         str(PROBE), token[:6], hashlib.sha256(token.encode()).hexdigest(), str(len(token)), str(out),
         *(["--memory"] if given == "env" else [])], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert seen["objects"] > 10_000, seen  # it looked at a real worker
    assert seen["regions"] > 10 or given == "flag", seen
    assert seen["found"] == [], seen


def _memory_with(pid: int, needle: bytes) -> list[str]:
    """The writable private mappings of process ``pid`` (heap, stack, anonymous) holding ``needle``."""
    hits = []
    with open(f"/proc/{pid}/maps") as m, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in m.read().splitlines():
            fields = line.split()
            where = fields[5] if len(fields) > 5 else ""
            if "r" not in fields[1] or where not in ("", "[heap]", "[stack]"):
                continue
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            try:
                mem.seek(lo)
                if needle in mem.read(hi - lo):
                    hits.append(f"{where or 'anonymous'} {fields[0]}")
            except OSError:
                continue
    return hits


def test_a_fresh_interpreter_preload_server_holds_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """When a fork is unsafe (threads, CUDA) the server is a fresh interpreter, and every worker
    forked from it inherits its memory: the test reads it. (A forked server starts with this
    test's own copies of the token; elastictk-run's forked one is read by the test above.)"""
    from elastictk.supervisor.forkserver import PreloadServer

    token = "tk" + secrets.token_hex(16)
    monkeypatch.setenv("ELASTICTK_RDZV_TOKEN", token)
    server = PreloadServer(preload=())
    try:
        server.start(fork=False)
        server.wait_ready(120)
        assert server.pid is not None and server.how.startswith("a fresh interpreter"), server.how
        assert _memory_with(server.pid, b"PATH=") != []  # the reader sees its environment
        assert _memory_with(server.pid, token.encode()) == []
    finally:
        server.close()
    assert os.environ["ELASTICTK_RDZV_TOKEN"] == token  # the owner keeps its own


def test_a_one_character_secret_is_not_overwritten_in_place() -> None:
    """CPython shares one object per one-character str and bytes: zeroing the token's would
    change every "x" in the server (run in a child: the planted bug corrupts its interpreter)."""
    code = ("from elastictk.supervisor.forget import _overwrite\n"
            "x, y = chr(120), bytes([121])\n_overwrite(x); _overwrite(y)\n"
            "assert chr(120) == 'x' and bytes([121]) == b'y', (chr(120), bytes([121]))\n"
            "z = 'tk' + str(12345)\n_overwrite(z)\nassert z == chr(0) * 7, repr(z)\nprint('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]

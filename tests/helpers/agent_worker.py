"""A tiny torchrun-style worker for launcher tests: no torch import, behaviour from argv.

    agent_worker.py OUT_DIR [--fail RESTART:RANK:HOW]... [--sleep S] [--trap-term S] [--child]

Writes ``OUT_DIR/attempt<RESTART>.rank<RANK>.json`` (its env) on start; ``--fail`` makes rank RANK
fail when TORCHELASTIC_RESTART_COUNT == RESTART, HOW being a signal name, ``exc`` or ``exit:N``;
``--trap-term S`` ignores SIGTERM for S seconds after receiving it, recording that it did;
``--child`` starts a sleeping grandchild and records its PID; ``--until NAME`` ends the sleep early
once ``OUT_DIR/NAME`` exists, so a test decides when the job may finish.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import elastictk


def _wait_for_the_attempts_starts(out: str, restart: int) -> None:
    """Fail only once every worker of this attempt recorded its start (at most 30 s): on a loaded
    machine a peer still starting was stopped by the failure before it wrote its line."""
    world, deadline = int(os.environ["WORLD_SIZE"]), time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(os.path.join(out, "starts.jsonl")) as f:
                started = [json.loads(x) for x in f if x.strip()]
        except OSError:
            started = []
        if sum(s.get("TORCHELASTIC_RESTART_COUNT") == str(restart) for s in started) >= world:
            return
        time.sleep(0.02)


@elastictk.record
def main() -> None:
    out, args = sys.argv[1], sys.argv[2:]
    rank = int(os.environ["RANK"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    env = {k: v for k, v in os.environ.items() if k in ENV_KEYS}
    env["pid"] = str(os.getpid())
    sleep, trap, fails, until = 0.2, None, [], None
    it = iter(args)
    for a in it:
        if a == "--fail":
            fails.append(next(it))
        elif a == "--sleep":
            sleep = float(next(it))
        elif a == "--until":
            until = os.path.join(out, next(it))
        elif a == "--trap-term":
            trap = float(next(it))
        elif a == "--child":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            env["child"] = str(child.pid)
    tag = f"attempt{restart}.rank{rank}"
    if trap is not None:
        def on_term(signum: int, frame: object) -> None:
            with open(os.path.join(out, f"{tag}.sigterm"), "w") as f:
                f.write(str(time.monotonic()))
            time.sleep(trap)
        signal.signal(signal.SIGTERM, on_term)
    with open(os.path.join(out, f"{tag}.json"), "w") as f:
        json.dump(env, f)
    # One line per worker start, appended atomically: several nodes share OUT_DIR.
    fd = os.open(os.path.join(out, "starts.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.write(fd, (json.dumps(env) + "\n").encode())
    os.close(fd)
    for spec in fails:
        at, who, how = spec.split(":", 2)
        if int(at) == restart and int(who) == rank:
            _wait_for_the_attempts_starts(out, restart)
            if how == "exc":
                raise ValueError(f"injected failure on rank {rank}")
            if how.startswith("exit:"):
                sys.exit(int(how[5:]))
            os.kill(os.getpid(), getattr(signal, how))
            time.sleep(5)
    deadline = time.monotonic() + sleep
    while time.monotonic() < deadline and not (until and os.path.exists(until)):
        time.sleep(0.05)


ENV_KEYS = {
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
}

if __name__ == "__main__":
    main()

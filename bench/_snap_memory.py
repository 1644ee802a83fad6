"""``bench snapshot``'s peak memory per node: a worker committing every step, its agent shipping.

Node A is a worker process (:mod:`bench._snap_node`: the state, committing every 100 ms step with
``--snapshot local --snapshot-overlap 1``) and its agent, which ships every sealed slot to node
B's agent (:mod:`bench._peer_agents`, both agents in one process). Sampled every 50 ms:

- the worker's RSS: anonymous (the state itself, torch, the interpreter) and shared (its mapping
  of the agent's snapshot memory);
- node A's local tier: the pages of the agent's memfd written so far (``st_blocks``);
- node B's replicas of A's part (held and arriving), bytes;
- the agents' process's own anonymous memory;
- how many steps A's replica on B lags behind A's newest commit (the agent's own gauge).

A job's node is both: it holds its own two slots and its ring predecessor's replica, so the
snapshot memory per node is A's local tier plus B's replicas, and the whole node is that plus
the worker's anonymous memory and the agent's. The bound the tiers hold: two local slots and one
replica, 3x the state (a replica arriving beside the one kept adds one part while it arrives).
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any, Optional

from ._peer_agents import Agents, _rss

STEPS = 30


def measure(size: int, agents: Agents, env: dict[str, str]) -> dict[str, Any]:
    """Peak figures (bytes) over a run of :data:`STEPS` committed steps; the agents are started."""
    import os

    proc = subprocess.Popen([sys.executable, "-m", "bench._snap_node", str(size), str(STEPS)],
                            env={**os.environ, **env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    peak: dict[str, int] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            mem = agents.ask("mem")
            w = _rss(proc.pid)
            now = {"worker_anon": w["rss_anon"], "worker_shmem": w["rss_shmem"],
                   "local": mem["local"], "replicas": mem["replicas"], "agents_anon": mem["rss_anon"],
                   "lag_steps": mem["lag"]}
            now["snapshot"] = now["local"] + now["replicas"]
            now["node"] = now["snapshot"] + now["worker_anon"] + now["agents_anon"]
            for k, v in now.items():
                peak[k] = max(peak.get(k, 0), v)
            stop.wait(0.05)

    try:
        assert proc.stdin is not None and proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the bench's worker ended (exit {proc.wait()})")
        base = _rss(proc.pid)["rss_anon"]
        sampler = threading.Thread(target=sample, name="bench-memory", daemon=True)
        sampler.start()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = proc.stdout.readline().split()
        if line[:1] != ["done"]:
            raise RuntimeError(f"the bench's worker ended (exit {proc.wait()})")
        agents.wait_replicated(int(line[1]), timeout=600)  # the last commit reaches the peer too
        time.sleep(0.2)
        stop.set()
        sampler.join()
        proc.stdin.write("end\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
        return {**peak, "worker_anon_before": base, "state": size, "steps": STEPS,
                "replicated": agents.ask("replicated")["step"], "committed": int(line[1]),
                "arrivals": agents.ask("arrivals")}
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def line(m: dict[str, Any]) -> str:
    """One note: the peaks, as bytes and as multiples of the state."""
    s = m["state"]

    def x(k: str) -> str:
        return f"{m[k] / 1e6:,.0f} MB ({m[k] / s:.2f}x)"

    return (f"{s // 10**6} MB state, peak memory per node over {m['steps']} steps committed every step "
            f"(local+peer, pipelined): snapshot memory {x('snapshot')} = local tier {x('local')} + "
            f"replica {x('replicas')}; worker RSS {x('worker_anon')} anonymous "
            f"({m['worker_anon_before'] / 1e6:,.0f} MB before the first commit) + {x('worker_shmem')} "
            f"shared; the agents' anonymous {m['agents_anon'] / 1e6:,.0f} MB; the whole node {x('node')}; "
            f"the replica lagged at most {m.get('lag_steps', 0)} steps behind the newest commit and "
            f"reached step {m['replicated']} of {m['committed']}")


def table(memory: dict[int, dict[str, Any]], tight: Optional[dict[int, dict[str, Any]]] = None) -> str:
    """The peaks of every size as a markdown table (multiples of the state in brackets);
    ``tight``: the same runs with the replicas bounded to one part (``--snapshot-replica-memory``)."""
    head = ("Peak memory per node over a run committing every step (local+peer, pipelined; "
            "before each size's timed rows), and the replica's lag; \"one part\": the replicas "
            "bounded to one part by `--snapshot-replica-memory` (1.5x the state), so the kept "
            "replica goes before its successor arrives:\n\n"
            "| state | snapshot memory (local + replica) | local tier | replicas | worker RSS "
            "anonymous + shared | agents' RSS anonymous | whole node (RSS + shared, agent and worker) "
            "| replica lag, most steps | replicas whole / torn |\n|---|---|---|---|---|---|---|---|---|")
    rows = []
    runs = [(s, m, "") for s, m in memory.items()] + [(s, m, ", one part") for s, m in (tight or {}).items()]
    for s, m, label in sorted(runs, key=lambda r: (r[0], r[2])):
        def x(k: str) -> str:
            return f"{m[k] / 1e6:,.0f} MB ({m[k] / s:.2f}x)"
        a = m.get("arrivals", {})
        rows.append(f"| {s // 10**6} MB{label} | {x('snapshot')} | {x('local')} | {x('replicas')} | "
                    f"{m['worker_anon'] / 1e6:,.0f} + {m['worker_shmem'] / 1e6:,.0f} MB | "
                    f"{m['agents_anon'] / 1e6:,.0f} MB | {x('node')} | {m.get('lag_steps', 0)} | "
                    f"{a.get('whole', '?')} / {a.get('torn', '?')} |")
    return "\n".join([head, *rows]) if rows else "(no memory figures: no size was run)"

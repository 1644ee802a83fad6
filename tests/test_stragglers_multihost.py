"""Stragglers across two test hosts: the leader on one host names a slow rank on the other.

Two network namespaces on a private bridge (tests/helpers/netns.py), each also in a UTS
namespace of its own with its own host name (as two machines have), one elastictk-run agent
each, two gloo workers per agent (bench/_straggler_worker.py: a fault checkpoint per step),
``--straggler-action report``. Host 1's agent alone gets a fault plan: from step 10 its local
rank 0 (global rank 0 or 2, whichever group rank host 1 drew) gets a ``slow:0.06`` fault at
every step, 4x its own time per step. The ``straggler`` event must name that rank, host 1's
host name and host 1's node; the same job without the plan must name no one.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.helpers.netns import Host, Hosts, kill_tree, leftover_namespaces, netns_works

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "bench" / "_straggler_worker.py")
PORT = 29400
CONF = "last_call_timeout=1,heartbeat_interval=0.2,heartbeat_timeout=3,join_timeout=60"
INTERVAL, WINDOWS = 0.5, 2
SLOW_FROM = 10


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    why = netns_works()
    if why is None and shutil.which("unshare") is None:
        why = "no `unshare` binary (util-linux) for the hosts' own host names"
    if why is not None:
        pytest.skip(f"test hosts need working network namespaces: {why}")
    hs = Hosts(2)
    try:
        yield hs
    finally:
        hs.close()
        assert leftover_namespaces(hs.tag) == [], "namespaces left behind"


def read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


class TwoHostJob:
    """One agent per host, host names ``<tag>-h0`` / ``<tag>-h1``; reaps its agents by PID."""

    def __init__(self, hosts: Hosts, tmp: Path) -> None:
        self.hosts, self.out = hosts, tmp / "out"
        self.out.mkdir()
        self.names = [f"etk-{hosts.tag}-h{h.index}" for h in hosts]
        self.agents: list[subprocess.Popen[str]] = []

    def events(self, i: int) -> Path:
        return self.out.parent / f"events{i}.jsonl"

    def start(self, host: Host, plan: Path | None = None) -> None:
        argv = [sys.executable, "-m", "elastictk.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.hosts[0].addr}:{PORT}",
                "--rdzv-id", "stragglers", "--rdzv-conf", CONF, "--local-addr", host.addr,
                "--straggler-action", "report", "--straggler-interval", str(INTERVAL),
                "--straggler-windows", str(WINDOWS), "--event-log", str(self.events(host.index)),
                "--log-dir", str(self.out.parent / f"logs{host.index}"),
                WORKER, str(self.out), "--mark-at", str(SLOW_FROM)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICTK_", "PET_"))}
        env["GLOO_SOCKET_IFNAME"] = "eth0"  # the host name resolves to nothing: name the link
        if plan is not None:
            env["ELASTICTK_FAULT_PLAN"] = str(plan)
            env["ELASTICTK_FAULT_LOG"] = str(self.out.parent / "faults.jsonl")
        # A host of its own also has a name of its own: a UTS namespace per agent.
        wrapped = ["unshare", "--uts", "sh", "-c", f'hostname {self.names[host.index]} && exec "$@"', "sh",
                   *argv]
        log = open(self.out.parent / f"agent{host.index}.log", "w")
        self.agents.append(host.popen(wrapped, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        log.close()

    def run(self, plan: Path | None, until: float) -> list[dict[str, Any]]:
        """Both agents; training past step SLOW_FROM; watch until a straggler event (or
        ``until`` seconds more); stop every rank; both agents exit 0. The straggler events."""
        self.start(self.hosts[0])
        self.hosts[1].wait_listening(self.hosts[0].addr, PORT)
        self.start(self.hosts[1], plan)
        self.wait(lambda: (self.out / "mark").exists(), 90, f"rank 0 at step {SLOW_FROM}")
        deadline = time.monotonic() + until
        while time.monotonic() < deadline and not self.stragglers():
            time.sleep(0.05)
        (self.out / "stop").touch()
        for i, a in enumerate(self.agents):
            assert a.wait(timeout=60) == 0, self.tail()
        return self.stragglers()

    def stragglers(self) -> list[dict[str, Any]]:
        return [e for i in range(2) for e in read(self.events(i)) if e["kind"] == "straggler"]

    def wait(self, pred: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < deadline, f"{what}: not within {timeout:g}s\n{self.tail()}"
            assert all(a.poll() is None for a in self.agents), f"an agent exited\n{self.tail()}"
            time.sleep(0.05)

    def logs(self) -> str:
        return "\n---\n".join((self.out.parent / f"agent{i}.log").read_text(errors="replace")
                              for i in range(len(self.agents)))

    def tail(self) -> str:
        return "\n---\n".join((self.out.parent / f"agent{i}.log").read_text(errors="replace")[-1500:]
                              for i in range(len(self.agents)))

    def close(self) -> None:
        for a in self.agents:
            kill_tree(a)
            a.wait()


def slow_plan(path: Path) -> Path:
    """Host 1's local rank 0 is global rank 0 or 2 (host 1's group rank decides): both are
    targeted, and only host 1's workers are given the plan."""
    faults = [{"kind": "slow:0.06", "target": f"rank:{r}", "at_step": s}
              for r in (0, 2) for s in range(SLOW_FROM, SLOW_FROM + 400)]
    path.write_text(json.dumps({"schema": "elastictk.fault-plan/1", "faults": faults}))
    return path


def test_the_slow_rank_on_the_other_host_is_named_with_its_host(hosts: Hosts, tmp_path: Path) -> None:
    job = TwoHostJob(hosts, tmp_path)
    try:
        named = job.run(slow_plan(tmp_path / "plan.json"), until=30)
    finally:
        job.close()
    fired = read(tmp_path / "faults.jsonl")
    slow = {f["rank"] for f in fired if "fault" in f}
    assert len(slow) == 1, f"one rank was slowed on host 1, fault log says {slow}"
    assert named, f"no straggler event\n{job.tail()}"
    node1 = {e["node_id"] for e in read(job.events(1))}
    assert len(node1) == 1
    for e in named:
        f = e["fields"]
        assert f["rank"] in slow, f"named rank {f['rank']}, the slow one is {slow}"
        assert f["host"] == job.names[1], f"named host {f['host']!r}, the slow rank runs on {job.names[1]!r}"
        assert f["straggler_node"] in node1 and f["slowdown"] >= 1.5
    # The leader (group rank 0) names it, wherever it runs; one line says so in its log.
    assert f"straggler: rank {named[0]['fields']['rank']} on host {job.names[1]}" in job.logs(), job.tail()


def test_no_one_is_named_without_a_slow_rank(hosts: Hosts, tmp_path: Path) -> None:
    job = TwoHostJob(hosts, tmp_path)
    try:
        named = job.run(None, until=INTERVAL * (WINDOWS + 6))
    finally:
        job.close()
    assert named == [], named
    assert "straggler:" not in job.logs(), job.tail()
    assert len({e["node_id"] for i in range(2) for e in read(job.events(i))}) == 2, "both hosts took part"

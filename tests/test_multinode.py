"""Several agents on loopback form one job: failures propagate, one restart budget, scale up/down.

Each agent is a real elastictk-run process; the c10d store is hosted by whichever agent binds
the endpoint first, and the others join it, as on a real cluster.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest

from elastictk.store import quiet_port

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "helpers" / "agent_worker.py")
CONF = "last_call_timeout=1,heartbeat_interval=0.2,heartbeat_timeout=2,join_timeout=60"


class Job:
    """A job id and endpoint shared by the agents a test starts; reaps them all."""

    def __init__(self, tmp: Path, nnodes: str = "2:3", max_restarts: int = 0, backend: str = "c10d") -> None:
        self.out = tmp / "out"
        self.out.mkdir()
        self.port = quiet_port()
        self.backend = backend
        self.endpoint = str(tmp / "rdzv") if backend == "file" else f"127.0.0.1:{self.port}"
        self.nnodes, self.max_restarts = nnodes, max_restarts
        self.conf = CONF
        self.agents: list[subprocess.Popen[str]] = []

    def command(self, *worker_args: str) -> list[str]:
        """One agent's elastictk-run command line (tests/test_multihost.py runs it in a namespace)."""
        return [sys.executable, "-m", "elastictk.run", "--nnodes", self.nnodes, "--nproc-per-node", "2",
                "--rdzv-backend", self.backend, "--rdzv-endpoint", self.endpoint, "--rdzv-id", "multi",
                "--rdzv-conf", self.conf, "--max-restarts", str(self.max_restarts), "--start-method", "spawn",
                "--shutdown-timeout", "2", WORKER, str(self.out), *worker_args]

    def agent(self, *worker_args: str) -> subprocess.Popen[str]:
        p = subprocess.Popen(self.command(*worker_args), cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.agents.append(p)
        return p

    def store_host(self) -> int:
        """The PID of the agent that won the race to host the c10d store (it listens on the port)."""
        for p in self.agents:
            for c in psutil.Process(p.pid).net_connections("tcp"):
                if c.status == psutil.CONN_LISTEN and c.laddr.port == self.port:
                    return p.pid
        raise AssertionError(f"no agent listens on port {self.port}")

    def starts(self) -> list[dict[str, str]]:
        path = self.out / "starts.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def wait_for(self, pred: Callable[[list[dict[str, str]]], bool], timeout: float = 240) -> list[dict[str, str]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.starts()
            if pred(s):
                return s
            time.sleep(0.1)
        for p in self.agents:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        logs = "\n---\n".join(p.communicate(timeout=60)[1][-1500:] for p in self.agents)
        seen = [(x["WORLD_SIZE"], x["RANK"], x["TORCHELASTIC_RESTART_COUNT"]) for x in self.starts()]
        raise AssertionError(f"condition not met; starts so far: {seen}\nagent logs:\n{logs}")

    def finish(self, timeout: float = 120) -> list[tuple[int, str]]:
        out = []
        for p in self.agents:
            try:
                _, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            out.append((p.returncode, err))
        return out

    def close(self) -> None:
        for p in self.agents:
            if p.poll() is None:
                p.kill()
            p.communicate()


@pytest.fixture
def job(tmp_path: Path, request: pytest.FixtureRequest) -> Job:
    j = Job(tmp_path, **getattr(request, "param", {}))
    request.addfinalizer(j.close)
    return j


def by_world(starts: list[dict[str, str]], world: int) -> list[dict[str, str]]:
    return [s for s in starts if s["WORLD_SIZE"] == str(world)]


@pytest.mark.parametrize("job", [{"nnodes": "2", "max_restarts": 1}], indirect=True)
def test_worker_failure_on_one_node_restarts_every_node_once(job: Job) -> None:
    for _ in range(2):
        job.agent("--sleep", "3", "--fail", "0:3:SIGKILL")
    results = job.finish()
    assert [rc for rc, _ in results] == [0, 0], [e[-2000:] for _, e in results]
    starts = job.starts()
    first = [s for s in starts if s["TORCHELASTIC_RESTART_COUNT"] == "0"]
    second = [s for s in starts if s["TORCHELASTIC_RESTART_COUNT"] == "1"]
    assert sorted(int(s["RANK"]) for s in first) == [0, 1, 2, 3]
    assert sorted(int(s["RANK"]) for s in second) == [0, 1, 2, 3], "every node restarted, together"
    assert len(starts) == 8, "one restart in total, not one per agent"
    assert {s["GROUP_WORLD_SIZE"] for s in starts} == {"2"}
    assert all("restart_count=1" in err for _, err in results), "both agents saw the same count"


@pytest.mark.parametrize("job", [{"nnodes": "2", "max_restarts": 1}], indirect=True)
def test_budget_spent_fails_the_job_everywhere_with_the_root_cause(job: Job) -> None:
    job.agent("--sleep", "20", "--fail", "0:1:SIGSEGV", "--fail", "1:2:exit:7")
    job.agent("--sleep", "20", "--fail", "0:1:SIGSEGV", "--fail", "1:2:exit:7")
    results = job.finish()
    assert [rc for rc, _ in results] == [1, 1], [e[-2000:] for _, e in results]
    both = "".join(err for _, err in results)
    assert "max-restarts" in both
    assert "exit code 7" in both, "the root cause of the last failure is named"
    assert len(job.starts()) == 8, "two attempts of four workers, then nobody restarts"


@pytest.mark.parametrize("job", [{"nnodes": "2:3"}], indirect=True)
def test_lost_agent_leaves_the_rest_running_at_a_smaller_world(job: Job) -> None:
    agents = [job.agent("--sleep", "120", "--until", "stop") for _ in range(3)]
    # Starts counted from the kill on: agents that start more than last call apart (a loaded
    # host) first form a round of two, a world of 4 too (a loaded make test saw 5 such starts).
    before = len(job.wait_for(lambda s: len(by_world(s, 6)) == 6))
    host_pid = job.store_host()
    victim = next(a for a in agents if a.pid != host_pid)  # losing the c10d host ends any c10d job
    victim.send_signal(signal.SIGKILL)
    starts = job.wait_for(lambda s: len(by_world(s[before:], 4)) == 4)[before:]
    assert {s["TORCHELASTIC_RESTART_COUNT"] for s in by_world(starts, 4)} == {"0"}, \
        "losing a node is a membership change, not a failure against --max-restarts 0"
    (job.out / "stop").touch()
    results = job.finish()
    codes = {p.pid: rc for p, (rc, _) in zip(job.agents, results)}
    assert codes[victim.pid] == -signal.SIGKILL
    assert all(rc == 0 for pid, rc in codes.items() if pid != victim.pid), results
    assert host_pid in codes


@pytest.mark.parametrize("job", [{"nnodes": "2:3"}], indirect=True)
def test_late_agent_scales_the_job_up(job: Job) -> None:
    for _ in range(2):
        job.agent("--sleep", "120", "--until", "stop")
    job.wait_for(lambda s: len(by_world(s, 4)) == 4)
    job.agent("--sleep", "120", "--until", "stop")
    starts = job.wait_for(lambda s: len(by_world(s, 6)) == 6)
    (job.out / "stop").touch()
    assert sorted(int(s["RANK"]) for s in by_world(starts, 6)) == list(range(6))
    assert {s["TORCHELASTIC_RESTART_COUNT"] for s in starts} == {"0"}, "scaling up costs no restart"
    results = job.finish()
    assert [rc for rc, _ in results] == [0, 0, 0], [e[-1500:] for _, e in results]


@pytest.mark.parametrize("job", [{"nnodes": "2", "backend": "file"}], indirect=True)
def test_node_arriving_after_the_job_finished_exits_zero(job: Job) -> None:
    job.agent("--sleep", "0.2")
    job.agent("--sleep", "0.2")
    first = job.finish()
    assert [rc for rc, _ in first] == [0, 0], [e[-1500:] for _, e in first]
    late = job.agent("--sleep", "0.2")
    _, err = late.communicate(timeout=300)  # a hang guard only: a loaded host took 42 s to get here
    assert late.returncode == 0, err[-1500:]
    # It learned at once that the job had finished: it never waited for peers (a node that did
    # would print "waiting for nodes" and end with a join timeout after 60 s, exit 1).
    assert "has finished" in err and "waiting for nodes" not in err, err[-1500:]
    assert len(job.starts()) == 4, "the late node started no worker"


@pytest.mark.parametrize("job", [{"nnodes": "2:3"}], indirect=True)
def test_losing_the_c10d_host_fails_fast_naming_the_store(job: Job) -> None:
    for _ in range(2):
        job.agent("--sleep", "120", "--until", "stop")
    job.wait_for(lambda s: len(by_world(s, 4)) == 4)
    host = job.store_host()
    os.kill(host, signal.SIGKILL)
    start = time.monotonic()
    results = job.finish(timeout=60)
    took = time.monotonic() - start
    (rc, err), = [(rc, err) for p, (rc, err) in zip(job.agents, results) if p.pid != host]
    assert rc == 1 and took < 30, err[-2000:]
    assert "Traceback" not in err
    assert "TCPStore" in err and "etcd" in err, "says what was lost and how to avoid it"


@pytest.mark.parametrize("job", [{"nnodes": "2:3"}], indirect=True)
def test_node_lost_while_the_others_wait_to_exit_does_not_hold_them(job: Job) -> None:
    # Node A (started first, so it hosts the c10d store) and B finish; C's workers run on.
    # C's agent dies while A and B sit in the exit barrier: they leave once its heartbeat
    # is missing (heartbeat_timeout 2 s), instead of waiting out the barrier's 300 s.
    a = job.agent("--sleep", "120", "--until", "stop")
    deadline = time.monotonic() + 60
    while True:
        try:
            assert job.store_host() == a.pid
            break
        except (AssertionError, psutil.Error):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    job.agent("--sleep", "120", "--until", "stop")
    c = job.agent("--sleep", "120", "--until", "never")
    job.wait_for(lambda s: len(by_world(s, 6)) == 6)
    (job.out / "stop").touch()
    pids = [int(s["pid"]) for s in by_world(job.starts(), 6)]
    deadline = time.monotonic() + 30
    while sum(psutil.pid_exists(p) for p in pids) > 2:  # A's and B's four workers exit
        assert time.monotonic() < deadline, "the finished nodes' workers did not exit"
        time.sleep(0.05)
    assert c.poll() is None, "C's agent still runs its two workers"
    time.sleep(0.5)  # A and B are in the exit barrier now
    c.send_signal(signal.SIGKILL)
    lost_at = time.monotonic()
    results = job.finish(timeout=60)
    took = time.monotonic() - lost_at
    codes = [rc for rc, _ in results]
    assert codes == [0, 0, -signal.SIGKILL], [e[-1500:] for _, e in results]
    assert took < 30, f"the finished nodes waited {took:.1f}s for a lost peer"
    assert all("exit_barrier_left" in err for _, err in results[:2]), [e[-1500:] for _, e in results[:2]]

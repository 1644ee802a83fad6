"""One job across several test hosts (network namespaces on a private bridge), for real.

Each host runs a real elastictk-run agent with ``ip netns exec``; hosts reach each other only
through their veth links, so a killed agent, a cut link or a lost store member is what it
would be on a cluster. Heartbeats are short (``--rdzv-conf``) and workers tiny
(tests/agent_worker.py), so each scenario takes seconds of waiting, not minutes.
"""
from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.netns import Host, Hosts, leftover_namespaces, netns_works
from tests.test_multinode import CONF, ROOT, Job, by_world

PORT = 29400


@pytest.fixture
def hosts(request: pytest.FixtureRequest) -> Iterator[Hosts]:
    """K test hosts (``indirect`` param, default 3); everything is gone after, also on failure."""
    why = netns_works()
    if why is not None:
        pytest.fail(f"test hosts need working network namespaces: {why}")
    hs = Hosts(getattr(request, "param", 3))
    try:
        yield hs
    finally:
        hs.close()
        assert leftover_namespaces(hs.tag) == [], "namespaces left behind"


class HostJob(Job):
    """A :class:`Job` whose agents run on test hosts instead of loopback."""

    def __init__(self, tmp: Path, hosts: Hosts, endpoint: str, backend: str = "c10d",
                 nnodes: str = "2:3", conf: str = CONF) -> None:
        super().__init__(tmp, nnodes=nnodes, backend=backend)
        self.hosts, self.endpoint, self.conf = hosts, endpoint, conf

    def agent_on(self, host: Host, *worker_args: str, env: dict[str, str] | None = None,
                 extra: tuple[str, ...] = ()) -> subprocess.Popen[str]:
        cmd = self.command(*worker_args)
        cmd[3:3] = list(extra)  # launcher flags go before the script
        p = host.popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.agents.append(p)
        return p


def wait_listening(host: Host, addr: str, port: int, timeout: float = 60) -> None:
    """Block until something accepts TCP connections at ``addr:port`` as seen from ``host``."""
    def probe() -> bool:
        try:
            socket.create_connection((addr, port), timeout=1).close()
            return True
        except OSError:
            return False

    deadline = time.monotonic() + timeout
    while not host.call(probe):
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing listens at {addr}:{port} after {timeout}s")
        time.sleep(0.1)


@pytest.fixture
def c10d_job(tmp_path: Path, hosts: Hosts) -> Iterator[HostJob]:
    """A c10d job whose store lives in host 0's agent (the endpoint is host 0's address)."""
    job = HostJob(tmp_path, hosts, f"{hosts[0].addr}:{PORT}")
    try:
        yield job
    finally:
        job.close()


def start_c10d(job: HostJob, *worker_args: str) -> list[subprocess.Popen[str]]:
    """An agent on every host; host 0's first, since it hosts the store the others connect to."""
    first = job.agent_on(job.hosts[0], *worker_args)
    wait_listening(job.hosts[1], job.hosts[0].addr, PORT)
    return [first] + [job.agent_on(h, *worker_args) for h in list(job.hosts)[1:]]


def test_lost_host_leaves_the_rest_running_and_its_return_scales_back_up(c10d_job: HostJob) -> None:
    job = c10d_job
    a, b, c = start_c10d(job, "--sleep", "300", "--until", "stop")
    job.wait_for(lambda s: len(by_world(s, 6)) == 6)
    c.send_signal(signal.SIGKILL)
    starts = job.wait_for(lambda s: len(by_world(s, 4)) == 4)
    assert {s["TORCHELASTIC_RESTART_COUNT"] for s in starts} == {"0"}, \
        "a lost host is a membership change, not a failure against --max-restarts 0"
    assert {s["MASTER_ADDR"] for s in by_world(starts, 4)} <= {job.hosts[0].addr, job.hosts[1].addr}
    c2 = job.agent_on(job.hosts[2], "--sleep", "300", "--until", "stop")
    starts = job.wait_for(lambda s: len(by_world(s, 6)) == 12)
    assert sorted(int(s["RANK"]) for s in by_world(starts, 6)[6:]) == list(range(6))
    assert {s["TORCHELASTIC_RESTART_COUNT"] for s in starts} == {"0"}, "scaling up costs no restart"
    assert_stops_cleanly(job, [a, b, c2])
    assert c.returncode == -signal.SIGKILL


def assert_stops_cleanly(job: HostJob, agents: list[subprocess.Popen[str]]) -> None:
    """SIGTERM ``agents``: each stops its workers and exits 128+SIGTERM, none hangs.

    (A job that finishes on its own after a membership change is issue 4's exit barrier,
    tested on loopback in tests/test_multinode.py; here the hosts are what is under test.)
    """
    for p in agents:
        p.send_signal(signal.SIGTERM)
    results = dict(zip((p.pid for p in job.agents), job.finish(timeout=60)))
    logs = "\n---\n".join(err[-1500:] for _, err in results.values())
    assert [results[p.pid][0] for p in agents] == [128 + signal.SIGTERM] * len(agents), logs

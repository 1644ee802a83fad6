"""One job across several test hosts (network namespaces on a private bridge), for real.

Each host runs a real elastictk-run agent with ``ip netns exec``; hosts reach each other only
through their veth links, so a killed agent, a cut link or a lost store member is what it
would be on a cluster. Heartbeats are short (``--rdzv-conf``) and workers tiny
(tests/helpers/agent_worker.py), so each scenario takes seconds of waiting, not minutes.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from tests.helpers.netns import Host, Hosts, etcd_members, kill_tree, leftover_namespaces, netns_works
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

    def close(self) -> None:
        # ``ip netns exec`` forks: the agent is its child, so the tree goes, leaves first
        # (only processes this job started, by PID), and no pipe is left open by an orphan.
        for p in self.agents:
            kill_tree(p)
        super().close()

    def __init__(self, tmp: Path, hosts: Hosts, endpoint: str, backend: str = "c10d",
                 nnodes: str = "2:3", conf: str = CONF) -> None:
        super().__init__(tmp, nnodes=nnodes, backend=backend)
        self.hosts, self.endpoint, self.conf = hosts, endpoint, conf

    def agent_on(self, host: Host, *worker_args: str, env: dict[str, str] | None = None,
                 extra: tuple[str, ...] = (), wrapper: str | None = None) -> subprocess.Popen[str]:
        cmd = self.command(*worker_args)
        cmd[3:3] = list(extra)  # launcher flags go before the script
        if wrapper is not None:  # python -c WRAPPER -m elastictk.run ...
            cmd[1:1] = ["-c", wrapper]
        p = host.popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.agents.append(p)
        return p


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
    job.hosts[1].wait_listening(job.hosts[0].addr, PORT)
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
    (job.out / "stop").touch()  # the job finishes on its own, on every host
    results = dict(zip((p.pid for p in job.agents), job.finish(timeout=60)))
    logs = "\n---\n".join(err[-1500:] for _, err in results.values())
    assert [results[p.pid][0] for p in (a, b, c2)] == [0, 0, 0], logs
    assert c.returncode == -signal.SIGKILL


def assert_stops_cleanly(job: HostJob, agents: list[subprocess.Popen[str]]) -> dict[int, tuple[int, str]]:
    """SIGTERM ``agents``: each stops its workers and exits 128+SIGTERM, none hangs; PID ->
    (exit code, stderr) of every agent of the job."""
    for p in agents:
        p.send_signal(signal.SIGTERM)
    results = dict(zip((p.pid for p in job.agents), job.finish(timeout=60)))
    logs = "\n---\n".join(err[-1500:] for _, err in results.values())
    assert [results[p.pid][0] for p in agents] == [128 + signal.SIGTERM] * len(agents), logs
    return results


LINK_CONF = CONF + ",read_timeout=4"


def test_cut_link_is_detected_by_heartbeat_and_the_cut_host_stops_its_workers(tmp_path: Path, hosts: Hosts) -> None:
    job = HostJob(tmp_path, hosts, f"{hosts[0].addr}:{PORT}", conf=LINK_CONF)
    try:
        a, b, c = start_c10d(job, "--sleep", "300", "--until", "stop")
        six = job.wait_for(lambda s: len(by_world(s, 6)) == 6)
        hosts[1].link_down()
        cut_at = time.monotonic()
        starts = job.wait_for(lambda s: len(by_world(s, 4)) == 4)
        assert {s["TORCHELASTIC_RESTART_COUNT"] for s in starts} == {"0"}
        assert {s["MASTER_ADDR"] for s in by_world(starts, 4)} <= {hosts[0].addr, hosts[2].addr}
        _, err = b.communicate(timeout=60)  # the cut host's agent ends by itself, it does not hang
        assert b.returncode == 1, err[-2000:]
        assert "Traceback" not in err, err[-2000:]
        assert time.monotonic() - cut_at < 60
        alive = [s["pid"] for s in six if psutil.pid_exists(int(s["pid"]))]
        assert alive == [], "every worker of the round before the cut is gone, the cut host's too"
        assert "heartbeat has not reached the rendezvous store" in err, "the cut host says why it stopped"
        results = assert_stops_cleanly(job, [a, c])
        seen = [line for pid in (a.pid, c.pid) for line in results[pid][1].splitlines() if "lost: no heartbeat" in line]
        assert seen, "the others lost the cut host by its heartbeat"
    finally:
        job.close()


FAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"


# Runs elastictk-run in a process that libfaketime was preloaded into, without passing the
# preload on to its workers, and records the agent's own wall clock first. libfaketime 0.9.10
# fails clock_nanosleep(TIMER_ABSTIME) with EINVAL when it leaves CLOCK_MONOTONIC alone, which
# breaks time.sleep: the agent sleeps on a timed wait instead, which it handles correctly.
SKEWED_AGENT = """
import os, runpy, sys, threading, time
time.sleep = lambda s: threading.Event().wait(s) and None
os.environ.pop("LD_PRELOAD")
with open(os.environ["AGENT_WALL_FILE"], "w") as f:
    f.write(repr(time.time()))
sys.argv = ["elastictk-run"] + sys.argv[3:]
runpy.run_module("elastictk.run", run_name="__main__", alter_sys=True)
"""


def test_host_whose_clock_is_30s_off_joins_and_is_not_declared_dead(tmp_path: Path, hosts: Hosts) -> None:
    assert os.path.exists(FAKETIME), "libfaketime missing: apt-get install faketime (make debs)"
    job = HostJob(tmp_path, hosts, f"{hosts[0].addr}:{PORT}")
    preloaded: list[int] = []
    try:
        a = job.agent_on(hosts[0], "--sleep", "300", "--until", "stop")
        hosts[1].wait_listening(hosts[0].addr, PORT)
        b = job.agent_on(hosts[1], "--sleep", "300", "--until", "stop")
        # Only the wall clock is off, as on a real host with a bad clock (libfaketime can shift
        # CLOCK_MONOTONIC too, but then glibc's timed waits sleep 30 s too long).
        wall_file = tmp_path / "agent-wall"
        skewed = dict(os.environ, LD_PRELOAD=FAKETIME, FAKETIME="+30s", FAKETIME_DONT_FAKE_MONOTONIC="1",
                      AGENT_WALL_FILE=str(wall_file))
        before = time.time()
        # Workers fork from the preload server (started without the preload), not from the
        # agent: a fork of a multi-threaded process with libfaketime loaded can deadlock in the
        # child on a lock libfaketime's clock calls hold (seen: the agent stuck in Popen).
        c = job.agent_on(hosts[2], "--sleep", "300", "--until", "stop", env=skewed, wrapper=SKEWED_AGENT,
                         extra=("--start-method", "preload"))
        preloaded.append(c.pid)
        job.wait_for(lambda s: len(by_world(s, 6)) == 6)
        assert float(wall_file.read_text()) - before > 25, "host 2's agent really lives 30 s ahead"
        time.sleep(3 * 2.0)  # three heartbeat timeouts: long enough for a skew to kill a node
        assert len(job.starts()) == 6, "no one was declared lost: no new round, no restart"
        ended = [(p.returncode, p.communicate()[1][-1500:]) for p in (a, b, c) if p.poll() is not None]
        assert ended == [], ended
        assert_stops_cleanly(job, [a, b, c])
    finally:
        job.close()
        for pid in preloaded:  # libfaketime leaves a segment and a semaphore per process it ran in
            for name in (f"faketime_shm_{pid}", f"sem.faketime_sem_{pid}"):
                Path("/dev/shm", name).unlink(missing_ok=True)


def test_etcd_job_survives_the_loss_of_a_store_member_and_its_host(tmp_path: Path, hosts: Hosts) -> None:
    members = etcd_members(hosts, tmp_path)
    endpoints = ",".join(f"{h.addr}:2379" for h in hosts)
    # etcd needs a second or two to elect a new leader when host A's member was the leader:
    # a heartbeat timeout longer than that, as a real job would use.
    job = HostJob(tmp_path, hosts, endpoints, backend="etcd", conf=CONF.replace("heartbeat_timeout=2", "heartbeat_timeout=5"))
    try:
        a, b, c = (job.agent_on(h, "--sleep", "300", "--until", "stop") for h in hosts)
        job.wait_for(lambda s: len(by_world(s, 6)) == 6)
        members[0].kill()  # host A loses its etcd member and its agent at once
        a.send_signal(signal.SIGKILL)
        starts = job.wait_for(lambda s: len(by_world(s, 4)) == 4)
        assert {s["TORCHELASTIC_RESTART_COUNT"] for s in starts} == {"0"}
        assert {s["MASTER_ADDR"] for s in by_world(starts, 4)} <= {hosts[1].addr, hosts[2].addr}
        assert_stops_cleanly(job, [b, c])
        assert a.returncode == -signal.SIGKILL
    finally:
        job.close()
        for m in members:
            m.close()


def test_a_host_without_the_job_token_is_refused_and_the_job_carries_on(c10d_job: HostJob) -> None:
    job, hosts = c10d_job, c10d_job.hosts
    member_env = dict(os.environ, ELASTICTK_RDZV_TOKEN="the-jobs-secret")
    a = job.agent_on(hosts[0], "--sleep", "300", "--until", "stop", env=member_env)
    hosts[1].wait_listening(hosts[0].addr, PORT)
    b = job.agent_on(hosts[1], "--sleep", "300", "--until", "stop", env=member_env)
    job.wait_for(lambda s: len(by_world(s, 4)) == 4)
    stranger = job.agent_on(hosts[2], "--sleep", "300", env=dict(os.environ, ELASTICTK_RDZV_TOKEN="a-guess"))
    _, err = stranger.communicate(timeout=60)
    assert stranger.returncode == 1, err[-2000:]
    assert "Traceback" not in err
    refusal = [line for line in err.splitlines() if "refused by job" in line]
    assert refusal and "ELASTICTK_RDZV_TOKEN" in refusal[-1], err[-2000:]
    time.sleep(3 * 2.0)  # three heartbeat timeouts: time for any disturbance to show
    assert len(job.starts()) == 4, "the refused host changed nothing: no new round, no restart"
    assert a.poll() is None and b.poll() is None
    assert_stops_cleanly(job, [a, b])

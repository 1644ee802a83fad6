"""Spares: a node beyond ``--nnodes`` MAX waits, costs the running job nothing, and takes a lost
member's place in the very next round.

Real elastictk-run agents and tiny workers (tests/helpers/agent_worker.py); short heartbeats and
last call through ``--rdzv-conf``. First on one host (TCPStore on loopback), then on test hosts
(network namespaces), as issue #21 asks: 4 hosts, ``--nnodes 2:3``, one killed, and the spare
trains in the first round after the loss with the world back at MAX (the time it took is printed;
bench/spares.py measures it).
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.helpers.netns import Hosts, leftover_namespaces, netns_works
from tests.test_multinode import ROOT, Job, by_world

# The product's default heartbeat timeout: a member whose heartbeat thread stalls past it on a
# busy host (2 s did, beside CPU hogs) is lost for good, which is not what these tests are about.
HB_TIMEOUT = 10.0
LAST_CALL = 1.0
CONF = (f"last_call_timeout={LAST_CALL:g},heartbeat_interval=0.2,heartbeat_timeout={HB_TIMEOUT:g},"
        "join_timeout=60")
# How long the members are watched for a re-form after the spare said it waits: the old
# behaviour (re-form on any arrival) closed the next round within last call.
REFORM_WINDOW = LAST_CALL + 2.0
RUN = ("--sleep", "120", "--until", "stop")


def events(path: Path, kind: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


def changes(logs: list[Path]) -> list[list[dict[str, Any]]]:
    """The membership changes each agent logged so far."""
    return [[e["fields"] for e in events(log, "membership_changed")] for log in logs]


def changes_since(logs: list[Path], before: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The membership changes logged after ``before`` (what :func:`changes` read then)."""
    return [c for now, then in zip(changes(logs), before) for c in now[len(then):]]


def wait_event(path: Path, kind: str, timeout: float = 240) -> dict[str, Any]:  # past a loaded host
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = events(path, kind)
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no {kind} event in {path.name} within {timeout:g}s")


class SpareJob(Job):
    """A :class:`Job` whose agents each write an event log (``agent(i)`` -> ``events<i>.jsonl``)."""

    def __init__(self, tmp: Path, nnodes: str) -> None:
        super().__init__(tmp, nnodes=nnodes)
        self.conf = CONF
        self.logs: list[Path] = []

    def argv(self, endpoint: str | None = None) -> list[str]:
        log = self.out.parent / f"events{len(self.logs)}.jsonl"
        self.logs.append(log)
        if endpoint is not None:
            self.endpoint = endpoint
        cmd = self.command(*RUN)
        cmd[3:3] = ["--event-log", str(log)]
        return cmd

    def spawn(self) -> subprocess.Popen[str]:
        p = subprocess.Popen(self.argv(), cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.agents.append(p)
        return p


@pytest.fixture
def job(tmp_path: Path) -> Iterator[SpareJob]:
    j = SpareJob(tmp_path, "1:2")
    try:
        yield j
    finally:
        j.close()


def test_spare_waits_without_restarting_the_job_and_replaces_a_lost_member(job: SpareJob) -> None:
    a, b = job.spawn(), job.spawn()
    job.wait_for(lambda s: len(by_world(s, 4)) == 4)
    # With --nnodes 1:2 the first agent may have trained alone before the second arrived (more
    # than last call apart on a busy host): what counts is what changes from here on.
    before, base = changes(job.logs[:2]), len(job.starts())
    spare = job.spawn()
    waiting = wait_event(job.logs[2], "spare_waiting")
    assert waiting["fields"]["world"] == 2
    # Long enough for the old behaviour (re-form on any arrival) to restart the full job:
    # its members would see the arrival at once and close the next round within last call.
    time.sleep(REFORM_WINDOW)
    changed = changes_since(job.logs[:2], before)
    assert changed == [], f"the members re-formed while the spare waited: {changed}"
    assert len(job.starts()) == base, "a spare's arrival must not re-form a full job"
    assert events(job.logs[2], "workers_started") == [] and spare.poll() is None
    victim = b if job.store_host() == a.pid else a  # losing the c10d host ends any c10d job
    victim.send_signal(signal.SIGKILL)
    starts = job.wait_for(lambda s: len(by_world(s, 4)) == 8)
    started = events(job.logs[2], "workers_started")
    assert len(started) == 1 and started[0]["fields"]["world_size"] == 4, "the spare trains, world back at 2 nodes"
    assert {s["TORCHELASTIC_RESTART_COUNT"] for s in starts} == {"0"}, "a lost node is no failure"
    assert sorted(int(s["RANK"]) for s in by_world(starts, 4)[4:]) == [0, 1, 2, 3]
    (job.out / "stop").touch()
    results = dict(zip((p.pid for p in job.agents), job.finish(timeout=60)))
    logs = "\n---\n".join(err[-1500:] for _, err in results.values())
    assert results[victim.pid][0] == -signal.SIGKILL
    assert [rc for pid, (rc, _) in results.items() if pid != victim.pid] == [0, 0], logs
    assert "waits as a spare" in results[spare.pid][1], "one log line says so"


PORT = 29400


def test_four_hosts_nnodes_2_3_the_spare_takes_the_lost_hosts_place_in_the_next_round(tmp_path: Path) -> None:
    why = netns_works()
    if why is not None:
        pytest.skip(f"test hosts need working network namespaces: {why}")
    hosts = Hosts(4)
    job = SpareJob(tmp_path, "2:3")
    try:
        endpoint = f"{hosts[0].addr}:{PORT}"

        def on(i: int) -> subprocess.Popen[str]:
            p = hosts[i].popen(job.argv(endpoint), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            job.agents.append(p)
            return p

        agents = [on(0)]
        hosts[1].wait_listening(hosts[0].addr, PORT)
        agents += [on(1), on(2)]
        job.wait_for(lambda s: len(by_world(s, 6)) == 6)
        # Hosts 0 and 1 may have formed a round of 2 before host 2 came (more than last call
        # apart on a busy host): what counts is what changes from here on.
        seen, base = changes(job.logs[:3]), len(job.starts())
        agents.append(on(3))
        wait_event(job.logs[3], "spare_waiting")
        time.sleep(REFORM_WINDOW)  # the old behaviour re-formed the full job within last call
        changed = changes_since(job.logs[:3], seen)
        assert changed == [], f"the members re-formed while the spare waited: {changed}"
        assert len(job.starts()) == base, "a spare's arrival must not re-form a full job"
        victim = agents[2]  # not host 0: it serves the store
        before = len(job.starts())
        killed = time.time()
        victim.send_signal(signal.SIGKILL)
        started = wait_event(job.logs[3], "workers_started", timeout=120)
        took = started["wall"] - killed
        assert started["fields"]["world_size"] == 6, "world back at MAX (3 nodes x 2)"
        # How soon is bench/spares.py's to measure; here, by the records: the round after the
        # loss already held the spare (the survivors never trained as a world of 2 nodes).
        assert by_world(job.starts()[before:], 4) == [], "the survivors re-formed without the spare first"
        starts = job.wait_for(lambda s: len(by_world(s, 6)) == 12)
        assert len(starts) == base + 6, "one re-form: the spare's arrival restarted nothing"
        assert {s["MASTER_ADDR"] for s in starts} == {hosts[0].addr}
        (job.out / "stop").touch()
        results = dict(zip((p.pid for p in job.agents), job.finish(timeout=60)))
        logs = "\n---\n".join(err[-1500:] for _, err in results.values())
        assert [results[p.pid][0] for p in agents if p is not victim] == [0, 0, 0], logs
        print(f"spare trained {took:.2f}s after the kill (heartbeat timeout {HB_TIMEOUT:g}s)")
    finally:
        job.close()
        hosts.close()
        assert leftover_namespaces(hosts.tag) == [], "namespaces left behind"

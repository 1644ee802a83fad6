"""Bad hosts are excluded for a cooldown (``--exclude-after R/T``, ``--exclude-cooldown S``,
``--straggler-action exclude``): real elastictk-run agents, tiny workers, short heartbeats.

- On three test hosts (network namespaces), ``--nnodes 1:2`` with a spare: the workers of one
  host keep failing; with ``--exclude-after 2/60`` it is excluded (its line, its event), the
  spare takes its place and the job succeeds, and the excluded node comes back after the
  cooldown (as a spare: the job runs full); without ``--exclude-after`` the same job spends its
  restarts on that host and fails.
- On loopback, the exclusion record: with a job token a forged ``exclude/<node>`` record
  excludes nobody, one sealed with the token does; without a token the same forged record
  excludes (the failing side). The excluded node rejoins after its cooldown and the job
  grows back to two nodes.
- A real straggler (gloo workers, one rank 60 ms slower per step): the leader names it and
  writes its node's record; that node leaves, the other finishes alone, and the excluded
  node's cooldown ends with the job.
- A health check failing in a round excludes the node (``--exclude-after`` on); healthy again,
  it rejoins after the cooldown.
- Bad flag values: one line naming the flag.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastictk.cli.args import main_for_test
from elastictk.rendezvous.auth import Signer
from elastictk.rendezvous.sealed import Records
from elastictk.store import PrefixStore, quiet_port
from elastictk.store.tcp import TCPStore
from tests.helpers.netns import Hosts, leftover_namespaces, netns_works
from tests.test_multinode import ROOT, Job, by_world
from tests.test_spares import events, wait_event

FLAKY = str(ROOT / "tests" / "helpers" / "flaky_worker.py")
CONF = "last_call_timeout=1,heartbeat_interval=0.2,heartbeat_timeout=2,join_timeout=60"
RUN = ("--sleep", "120", "--until", "stop")
TOKEN = "exclusion-test-token"


class ExclusionJob(Job):
    """A :class:`Job` whose agents run the flaky worker, each with an event log and own flags."""

    def __init__(self, tmp: Path, nnodes: str, max_restarts: int, flags: list[str]) -> None:
        super().__init__(tmp, nnodes=nnodes, max_restarts=max_restarts)
        self.conf = CONF
        self.flags = flags
        self.logs: list[Path] = []

    def argv(self) -> list[str]:
        log = self.out.parent / f"events{len(self.logs)}.jsonl"
        self.logs.append(log)
        cmd = [FLAKY if a.endswith("agent_worker.py") else a for a in self.command(*RUN)]
        cmd[3:3] = ["--event-log", str(log), *self.flags]
        return cmd


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTICTK_", "FLAKY_"))}
    return {**base, **extra}


def kinds(path: Path) -> list[str]:
    return [r["kind"] for r in map(json.loads, path.read_text().splitlines())] if path.exists() else []


# --- three test hosts: a host whose workers keep failing ---------------------------------------

PORT = 29400


@pytest.mark.parametrize("exclude", [True, False], ids=["exclude-after-2-60", "off"])
def test_a_host_whose_workers_keep_failing_is_excluded_and_the_spare_takes_its_place(
        tmp_path: Path, exclude: bool) -> None:
    why = netns_works()
    if why is not None:
        pytest.skip(f"test hosts need working network namespaces: {why}")
    flags = ["--exclude-after", "2/60", "--exclude-cooldown", "3"] if exclude else []
    hosts = Hosts(3)
    job = ExclusionJob(tmp_path, "1:2", max_restarts=2, flags=flags)
    try:
        job.endpoint = f"{hosts[0].addr}:{PORT}"

        def on(i: int, **extra: str) -> subprocess.Popen[str]:
            p = hosts[i].popen(job.argv(), env=env(**extra), cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
            job.agents.append(p)
            return p

        good = on(0)
        hosts[1].wait_listening(hosts[0].addr, PORT, timeout=300)  # far past a loaded host's start-up (60 s ran out)
        bad = on(1, FLAKY_NODE="1")
        job.wait_for(lambda s: len(by_world(s, 4)) == 2)  # hosts 0 and 1 (host 1's workers wait for "go")
        spare = on(2)
        wait_event(job.logs[2], "spare_waiting")
        (job.out / "go").touch()  # host 1 goes bad
        if not exclude:
            results = dict(zip((p.pid for p in job.agents), job.finish(timeout=240)))
            logs = "\n---\n".join(err[-1500:] for _, err in results.values())
            assert results[good.pid][0] == 1 and results[bad.pid][0] == 1, logs
            assert "max-restarts" in results[good.pid][1], "the bad host spent the job's restarts"
            assert all("node_excluded" not in kinds(log) for log in job.logs), "off: nobody is excluded"
            assert events(job.logs[2], "workers_started") == [], "the spare never got a place"
            return
        excluded = wait_event(job.logs[1], "node_excluded", timeout=240)["fields"]
        assert excluded["reason"] == "failures" and excluded["cooldown_s"] == 3
        assert "failed 2 times" in excluded["detail"] and "--exclude-after 2/60" in excluded["detail"]
        started = wait_event(job.logs[2], "workers_started", timeout=240)["fields"]
        assert started["world_size"] == 4, "the spare takes the excluded host's place"
        job.wait_for(lambda s: len([x for x in by_world(s, 4) if x["TORCHELASTIC_RESTART_COUNT"] == "2"]) == 4)
        # After the 3 s cooldown the excluded node rejoins (under a new id): the job runs full,
        # so it waits as a spare; the others go on untouched.
        back = wait_event(job.logs[1], "spare_waiting", timeout=240)
        assert back["wall"] - wait_event(job.logs[1], "node_excluded")["wall"] >= 3.0, "out for the cooldown"
        assert kinds(job.logs[1]).count("rendezvous_started") >= 3
        (job.out / "stop").touch()
        results = dict(zip((p.pid for p in job.agents), job.finish(timeout=240)))
        logs = "\n---\n".join(err[-1500:] for _, err in results.values())
        assert results[good.pid][0] == 0 and results[spare.pid][0] == 0, logs
        err = results[bad.pid][1]
        lines = [ln for ln in err.splitlines() if " excluded for 3s: its workers failed 2 times in " in ln]
        assert len(lines) == 1, err[-3000:]
        assert "rejoins after the cooldown" in lines[0]
        assert "cooldown of 3s over; it rejoins the job as node " in err
    finally:
        for p in job.agents:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        job.close()
        hosts.close()
        assert leftover_namespaces(hosts.tag) == [], "namespaces left behind"


# --- the record on loopback: forged, sealed, no token ------------------------------------------

def node_and_round(log: Path) -> tuple[str, int]:
    node = wait_event(log, "rendezvous_started")["fields"]["node_id"]
    rounds = [e["fields"]["round"] for e in events(log, "round_joined")]
    return node, rounds[-1]


def write_record(port: int, round_: int, node: str, signer: Signer) -> None:
    """An exclusion record for ``node`` in round ``round_``'s store, as ``signer`` seals it."""
    tcp = TCPStore.connect(f"127.0.0.1:{port}")
    try:
        prefix = f"rdzv/multi/r/{round_}/job"
        Records(PrefixStore(prefix, tcp), prefix, signer).write(f"exclude/{node}", {
            "node_id": node, "reason": "straggler", "detail": "named by the test", "cooldown_s": 2,
            "by": "test"})
    finally:
        tcp.close()


def run_nonce(port: int) -> str:
    tcp = TCPStore.connect(f"127.0.0.1:{port}")
    try:
        raw = tcp.try_get("rdzv/multi/auth")
        assert raw is not None
        return str(json.loads(raw)["run"])
    finally:
        tcp.close()


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token", "no-token"])
def test_a_forged_record_excludes_nobody_with_a_token_and_the_node_rejoins(tmp_path: Path, token: str | None) -> None:
    flags = ["--straggler-action", "exclude", "--straggler-interval", "0.2", "--exclude-cooldown", "2"]
    job = ExclusionJob(tmp_path, "1:2", max_restarts=1, flags=flags)
    # A 2 s heartbeat timeout let a loaded host (the suite's three processes) lose a node for a
    # moment and restart the round inside the 2 s this test watches for "nothing restarted";
    # nothing here needs a lost node noticed quickly.
    job.conf = CONF.replace("heartbeat_timeout=2", "heartbeat_timeout=20")
    extra = {"ELASTICTK_RDZV_TOKEN": token} if token else {}
    try:
        for _ in range(2):
            job.agents.append(subprocess.Popen(job.argv(), cwd=ROOT, text=True, env=env(**extra),
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        job.wait_for(lambda s: len(by_world(s, 4)) == 4)
        # On a loaded host the first agent up may form a round alone (--nnodes 1:2, 1 s last call)
        # before the second comes: its world-2 starts are counted from here on, not from zero.
        alone, started = len(by_world(job.starts(), 2)), len(job.starts())
        host = job.store_host()
        i = next(i for i, p in enumerate(job.agents) if p.pid != host)  # excluding the store's host ends a c10d job
        node, round_ = node_and_round(job.logs[i])
        write_record(job.port, round_, node, Signer(None))  # forged: no MAC
        if token:
            time.sleep(2.0)  # ten straggler intervals: the node reads its key every one
            assert "node_excluded" not in kinds(job.logs[i]), "a forged record excluded a node"
            assert len(job.starts()) == started, ("nothing restarted", [kinds(log) for log in job.logs])
            write_record(job.port, round_, node, Signer(token, "multi", run_nonce(job.port)))
        excluded = wait_event(job.logs[i], "node_excluded", timeout=240)["fields"]
        assert excluded == {"node_id": node, "reason": "straggler", "detail": "named by the test",
                            "cooldown_s": 2, "by": "test"}
        # The other node goes on alone (world 2), then the excluded one rejoins: world 4 again.
        job.wait_for(lambda s: len(by_world(s, 2)) == alone + 2)
        job.wait_for(lambda s: len(by_world(s, 4)) == 8)
        rejoined = [e for e in events(job.logs[i], "rendezvous_started") if e["fields"]["node_id"] != node]
        assert rejoined and rejoined[0]["fields"]["node_id"] == f"{node}-rejoin1"
        (job.out / "stop").touch()
        results = job.finish(timeout=240)
        assert [rc for rc, _ in results] == [0, 0], [e[-1500:] for _, e in results]
        err = results[i][1]
        assert sum(1 for ln in err.splitlines() if f"node {node} excluded for 2s: named by the test" in ln) == 1
        if token:
            assert f"ignored store key 'rdzv/multi/r/{round_}/job/exclude/{node}'" in err
    finally:
        job.close()


# --- a real straggler: the leader decides, the flagged node learns it from the record -------------

LOOP = str(ROOT / "tests" / "helpers" / "straggler_loop.py")


def test_a_straggler_flagged_by_the_leader_is_excluded_and_the_job_finishes_without_it(tmp_path: Path) -> None:
    """Two agents of one gloo worker each; rank 1 spends 60 ms more of its own per step. The
    leader (group rank 0) names it and writes its node's sealed record; that node leaves, the
    other finishes alone; the excluded node's 60 s cooldown ends as soon as the job does."""
    port, logs = quiet_port(), [tmp_path / "events0.jsonl", tmp_path / "events1.jsonl"]

    def agent(log: Path) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "elastictk.run", "--event-log", str(log), "--nnodes", "1:2",
             "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", "strag", "--rdzv-conf", CONF, "--max-restarts", "1", "--straggler-action", "exclude",
             "--straggler-interval", "0.5", "--straggler-windows", "2", "--exclude-cooldown", "60",
             LOOP, "--steps", "150", "--slow-rank", "1", "--slow", "0.06"],
            cwd=tmp_path, text=True, env=env(ELASTICTK_RDZV_TOKEN=TOKEN), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)

    procs = [agent(logs[0]), agent(logs[1])]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
        joined = [events(log, "round_joined")[0]["fields"]["rank"] for log in logs]
        leader, flagged = joined.index(0), joined.index(1)
        nodes = [events(log, "rendezvous_started")[0]["fields"]["node_id"] for log in logs]
        out = events(logs[flagged], "node_excluded")
        assert len(out) == 1, outs[flagged][1][-3000:]
        f = out[0]["fields"]
        assert f["reason"] == "straggler" and f["by"] == nodes[leader] and f["node_id"] == nodes[flagged]
        assert "rank 1 on host" in f["detail"] and "--straggler-action exclude" in f["detail"]
        assert procs[leader].returncode == 0, outs[leader][1][-3000:]
        assert [e["fields"]["world"] for e in events(logs[leader], "round_joined")][-1] == 1, "finished alone"
        assert procs[flagged].returncode == 1 and "has finished" in outs[flagged][1], outs[flagged][1][-2000:]
        left = time.time() - out[0]["wall"]
        assert left < 45, f"the 60 s cooldown did not end with the job ({left:.1f}s)"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


# --- a health check failing in a round ----------------------------------------------------------

def test_a_node_whose_health_check_fails_in_a_round_is_excluded(tmp_path: Path) -> None:
    flags = ["--health-check", 'test ! -e "$SICK_MARK"', "--health-interval", "0.3",
             "--exclude-after", "5/60", "--exclude-cooldown", "1"]
    job = ExclusionJob(tmp_path, "1:2", max_restarts=1, flags=flags)
    sick = tmp_path / "sick"
    try:
        for mark in ("/nonexistent/never", str(sick)):
            job.agents.append(subprocess.Popen(job.argv(), cwd=ROOT, text=True, env=env(SICK_MARK=mark),
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        job.wait_for(lambda s: len(by_world(s, 4)) == 4)
        alone = len(by_world(job.starts(), 2))  # a first round of one node on a loaded host, or none
        sick.touch()
        f = wait_event(job.logs[1], "node_excluded", timeout=240)["fields"]
        assert f["reason"] == "health_check" and f["cooldown_s"] == 1 and "health check failed" in f["detail"]
        job.wait_for(lambda s: len(by_world(s, 2)) == alone + 2)  # the other node goes on alone
        sick.unlink()  # healthy again: back after the cooldown, the job at two nodes again
        job.wait_for(lambda s: len(by_world(s, 4)) == 8)
        (job.out / "stop").touch()
        results = job.finish(timeout=240)
        assert [rc for rc, _ in results] == [0, 0], [e[-1500:] for _, e in results]
    finally:
        job.close()


# --- flags ---------------------------------------------------------------------------------------

WORKER = str(ROOT / "tests" / "helpers" / "agent_worker.py")
C10D = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]


@pytest.mark.parametrize("argv,names", [
    (["--exclude-after", "3"], ["--exclude-after", "R/T", "3/60"]),
    (["--exclude-after", "0/60"], ["--exclude-after", "R >= 1"]),
    (["--exclude-after", "3/-1"], ["--exclude-after", "seconds"]),
    (["--exclude-after", "x/60"], ["--exclude-after", "whole number"]),
    (["--exclude-after", "3/9999999999"], ["--exclude-after", "30 days"]),
    (["--exclude-cooldown", "soon"], ["--exclude-cooldown", "number of seconds"]),
    (["--exclude-cooldown", "0"], ["--exclude-cooldown", "more than 0"]),
    (["--exclude-cooldown", "1e9"], ["--exclude-cooldown", "a week"]),
    (["--exclude-after", "3/60", "--recovery", "in-place"], ["--exclude-after", "--recovery"]),
    (["--straggler-action", "exclude", "--recovery", "in-place"], ["--straggler-action exclude", "--recovery"]),
])
def test_bad_values_get_one_line_naming_the_flag(argv: list[str], names: list[str]) -> None:
    rc, err, config = main_for_test([*argv, *C10D, WORKER], environ=env())
    assert rc == 2 and config is None, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(n in lines[0] for n in names), lines[0]


def test_environment_and_defaults() -> None:
    rc, err, config = main_for_test([*C10D, WORKER], environ=env(ELASTICTK_EXCLUDE_AFTER="4/30"))
    assert rc == 0 and config is not None, err
    assert (config.exclude_after, config.exclude_cooldown) == ((4, 30.0), 300.0)
    rc, err, config = main_for_test(["--exclude-cooldown", "5", *C10D, WORKER], environ=env())
    assert rc == 0 and config is not None and config.exclude_after is None
    assert "--exclude-cooldown has no effect" in err
    rc, err, config = main_for_test(["--exclude-after", "x/1", *C10D, WORKER],
                                    environ=env(ELASTICTK_EXCLUDE_AFTER="2/10"))
    assert rc == 2, "the flag wins over the environment"

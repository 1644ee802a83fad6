"""A stranger without the job's token writes hostile values (a kilobyte of ``[``, a record with
an empty MAC) into the keys a running token job acts on: the job's ``failed`` key, the next
round's slot, ``inplace/host``, ``exclude/<node>`` and a straggler record. Every watch thread
keeps watching, no value ends or restarts the job, and a real elastictk-run job exits 0."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from elastictk.agent.coordination import RoundCoordinator
from elastictk.agent.inplace_host import HOST_KEY, InPlaceHost, Setup
from elastictk.agent.stragglers import StragglerWatch, key as straggle_key
from elastictk.metrics.steps import WorkerStepsBlock
from elastictk.rendezvous import MembershipWatch, RendezvousHandler, RendezvousStateError
from elastictk.store import TCPStore, quiet_port
from tests.test_rendezvous import fast, infos, join_all, server  # noqa: F401 - fixture
from tests.test_signed_records import agree_inplace

TOKEN = "hostile-store-token"
NESTED = b"[" * 1000
EMPTY_MAC = json.dumps({"headline": "forged", "mac": "", "node_id": "mallory"}, separators=(",", ":")).encode()


def watch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t.name.startswith(("elastictk-watch", "elastictk-failure", "elastictk-stragglers"))]


@pytest.fixture
def stranger(server: TCPStore) -> Iterator[TCPStore]:  # noqa: F811 - the fixture above
    s = TCPStore.connect(f"127.0.0.1:{server.port}", timeout=20)
    yield s
    s.close()


def handlers(server: TCPStore, job: str, ids: str, token: str | None) -> list[RendezvousHandler]:  # noqa: F811
    return [RendezvousHandler(TCPStore.connect(f"127.0.0.1:{server.port}", timeout=20),
                              fast(job, len(ids), len(ids) + 1, token=token), node_id=n) for n in ids]


@pytest.mark.parametrize("value", [NESTED, EMPTY_MAC], ids=["nested", "empty-mac"])
def test_the_failure_and_membership_watches_outlive_hostile_values(
        server: TCPStore, stranger: TCPStore, value: bytes) -> None:  # noqa: F811
    hs = handlers(server, "watches", "ab", TOKEN)
    rounds = infos(join_all(hs))
    a, info = hs[0], rounds["a"]
    woken, errors = threading.Event(), []
    watch = MembershipWatch(a, info)
    coord = RoundCoordinator(a.store, info.store, "a", on_failure=woken.set, signer=a.signer,
                             where=(a.prefix, info.store_prefix), on_error=errors.append)
    threads = watch_threads()
    try:
        stranger.set(f"{info.store_prefix}/failed", value)
        stranger.set(f"{a.prefix}/r/{info.round + 1}/slot/1", value)
        stranger.add(f"{a.prefix}/r/{info.round + 1}/arrivals", 1)
        time.sleep(2.5)  # heartbeat_timeout (1 s) and a failure-watch wait (1 s) past
        assert not errors and coord.watch_error is None, f"the failure watch stopped: {errors!r}"
        assert not woken.is_set(), "a stranger's value is no failure"
        assert not watch.changed.is_set(), f"a stranger's value changed the membership: {watch.reason}"
        assert all(t.is_alive() for t in threads)
        assert coord.failure_note() is None
    finally:
        watch.stop(wait=True)
        coord.stop(wait=True)
        for h in hs:
            h.close()


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token", "no-token"])
def test_a_nested_inplace_host_record_is_absent_or_one_line(
        server: TCPStore, stranger: TCPStore, token: str | None) -> None:  # noqa: F811
    (h,) = handlers(server, "iphost" + ("t" if token else "n"), "a", token)
    info = infos(join_all([h]))["a"]
    host = InPlaceHost("127.0.0.1", "a")
    try:
        stranger.set(f"{h.prefix}/{HOST_KEY}", NESTED)
        if token:
            setup = agree_inplace(host, h, info)
            assert isinstance(setup, Setup) and not setup.keep
            assert h.records.read(HOST_KEY) == {"node_id": "a"}, "the stranger's bytes were replaced"
        else:  # believed as is without a token: garbage is the one-line error naming the key
            with pytest.raises(RendezvousStateError, match=f"{h.prefix}/{HOST_KEY}.*nested"):
                agree_inplace(host, h, info)
    finally:
        host.close()
        h.close()


class Gate:
    """What the straggler watch needs of the agent's exclusions; records what it was handed."""

    min_nodes = 1
    cooldown = 60.0

    def __init__(self) -> None:
        self.bodies: list[Any] = []

    def on_record(self, node_id: str, body: dict[str, Any] | None) -> bool:
        self.bodies.append(body)
        return False


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token", "no-token"])
def test_the_straggler_watch_outlives_hostile_exclusion_and_straggler_records(
        server: TCPStore, stranger: TCPStore, token: str | None) -> None:  # noqa: F811
    hs = handlers(server, "strag" + ("t" if token else "n"), "ab", token)
    rounds = infos(join_all(hs))
    leader = next(h for h in hs if rounds[h.node_id].rank == 0)
    other = next(h for h in hs if h is not leader)
    info = rounds[leader.node_id]
    gate = Gate()
    with WorkerStepsBlock(1) as block:
        records = leader.records.view(info.store, info.store_prefix)
        watch = StragglerWatch(block, {0: 0}, records, node_id=leader.node_id, members=["a", "b"],
                               leader=True, interval=0.1, threshold=2.0, windows=2,
                               emit=lambda *_a, **_k: None, exclude=gate)
        try:
            stranger.set(f"{info.store_prefix}/exclude/{leader.node_id}", NESTED)
            stranger.set(f"{info.store_prefix}/{straggle_key(other.node_id)}", NESTED)
            time.sleep(1.0)  # ten intervals
            assert watch._thread.is_alive(), "the straggler watch stopped on a stranger's value"
            assert not any(gate.bodies), "a stranger's value excluded nobody"
        finally:
            watch.stop()
            watch._thread.join(5)
            for h in hs:
                h.close()


# --- end to end: a real token job over the c10d store ----------------------------------------------

WORKER = """
import os, sys, time, pathlib
d = pathlib.Path(sys.argv[1])
(d / f"started-{os.getpid()}").touch()
deadline = time.monotonic() + 90
while not (d / "go").exists():
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.05)
"""
CONF = "last_call_timeout=0.3,heartbeat_interval=0.2,heartbeat_timeout=1,join_timeout=60"


@pytest.mark.parametrize("where,value", [("failed", NESTED), ("failed", EMPTY_MAC), ("slot", NESTED)],
                         ids=["failed-nested", "failed-empty-mac", "next-slot-nested"])
def test_a_token_job_runs_on_through_a_strangers_hostile_value(tmp_path: Path, where: str, value: bytes) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port, log = quiet_port(), tmp_path / "events.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTICTK_"))}
    agent = subprocess.Popen(
        [sys.executable, "-m", "elastictk.run", "--nnodes", "1:2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hostile",
         "--rdzv-conf", CONF, "--max-restarts", "1", "--event-log", str(log), str(script), str(tmp_path)],
        env={**env, "ELASTICTK_RDZV_TOKEN": TOKEN}, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while not list(tmp_path.glob("started-*")) and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(tmp_path.glob("started-*")), "the worker never started"
        store = TCPStore.connect(f"127.0.0.1:{port}", timeout=20)
        try:
            if where == "failed":
                store.set("rdzv/hostile/r/1/job/failed", value)
            else:
                store.set("rdzv/hostile/r/2/slot/1", value)
                store.add("rdzv/hostile/r/2/arrivals", 1)
        finally:
            store.close()
        time.sleep(2.5)  # past heartbeat_timeout and the failure watch's wait
        assert agent.poll() is None, f"the job ended: {agent.communicate()[1][-3000:]}"
        (tmp_path / "go").touch()
        _, err = agent.communicate(timeout=90)
        assert agent.returncode == 0, err[-3000:]
        assert len(list(tmp_path.glob("started-*"))) == 1, "a stranger's value restarted the workers"
        assert "Traceback" not in err and "RecursionError" not in err, err[-3000:]
        kinds = [json.loads(line)["kind"] for line in log.read_text().splitlines()]
        assert "restart" not in kinds and "membership_changed" not in kinds, kinds
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()

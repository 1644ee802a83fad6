"""Exactly-once data when nodes leave and join mid-epoch, on network-namespace test hosts (root).

tests/helpers/data_train.py (DDP over ``elastictk.data``'s ``DataLoader`` with 2 workers and
``ElasticSampler``), one rank per host, ``--nnodes 2:3`` over c10d (host 0 holds the store),
``--snapshot disk`` every step on a directory all hosts share: a lost host's agent is
SIGKILLed mid-epoch (3 -> 2 ranks), or a third host's agent starts mid-epoch (2 -> 3 ranks).
The workers restart at the new world size and restore the newest step every rank holds.

The verdict comes from the runtime's own records (``ELASTICTK_FAULT_LOG``, written by the loader,
judged by elastictk/chaos/samples.py): in the final history each epoch's trained indices are
the dataset exactly (no padding: 108 samples, 6 per rank, cut into global batches of 12 or 18,
leave a rest every world size divides), and the world size changed inside an epoch.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest

from elastictk.chaos import samples
from tests.helpers.netns import Hosts, kill_tree, leftover_namespaces, netns_works

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "helpers" / "data_train.py"
# join_timeout 600: a node waits for the other's start-up, which took 30-140 s at a load average of 15-20
CONF = "last_call_timeout=1,heartbeat_interval=0.3,heartbeat_timeout=4,join_timeout=600"
PORT = 29400
SAMPLES, BATCH, EPOCHS = 108, 6, 2


def _wait(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)


def _run(tmp: Path, change: str) -> tuple[list[samples.Line], samples.Verdict, str]:
    """``change``: "leave" (3 hosts, host 2's agent SIGKILLed at step 3) or "join" (2 hosts,
    host 2's agent started at step 3, where the two wait for it: its start-up takes a minute
    on a loaded host, longer than the rest of the job). The data lines, the verdict and the
    agents' logs."""
    why = netns_works()
    if why is not None:
        pytest.fail(f"test hosts need working network namespaces: {why}")
    log, record = tmp / "faults.jsonl", tmp / "record.jsonl"
    env = {**os.environ, "ELASTICTK_FAULT_LOG": str(log), "GLOO_SOCKET_IFNAME": "eth0"}
    hosts = Hosts(3)
    agents: list[subprocess.Popen[str]] = []
    try:
        def on(i: int) -> subprocess.Popen[str]:
            argv = [sys.executable, "-m", "elastictk.run", "--nnodes", "2:3", "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].addr}:{PORT}", "--rdzv-id",
                    "data", "--rdzv-conf", CONF, "--start-method", "spawn", "--max-restarts", "6",
                    "--snapshot", "disk", "--snapshot-dir", str(tmp / "ckpt"), "--snapshot-every", "1",
                    str(SCRIPT), "--record", str(record), "--out", str(tmp / "w.pt"), "--samples",
                    str(SAMPLES), "--batch", str(BATCH), "--epochs", str(EPOCHS), "--step-time", "0.3"]
            if change == "join":  # the two train no further than step 3 until the third is in
                argv += ["--hold-at", "3:3"]
            p = hosts[i].popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            agents.append(p)
            return p

        def step() -> int:
            lines = record.read_text().splitlines() if record.exists() else []
            return max((json.loads(x)["step"] for x in lines if x.endswith("}")), default=0)

        on(0)
        hosts[1].wait_listening(hosts[0].addr, PORT, timeout=300)  # far past a loaded host's start-up
        on(1)
        if change == "leave":
            on(2)
        _wait(lambda: step() >= 3, 300, "step 3")  # two agents' start-up: minutes at a load of 20
        if change == "leave":
            from elastictk.lifetime import procfs

            tree = set(procfs.descendants(agents[2].pid)) | {agents[2].pid}
            agent = next(p for p in sorted(tree) if "elastictk.run" in (procfs.cmdline(p) or ""))
            os.kill(agent, signal.SIGKILL)  # its worker dies with it: the host is lost
        else:
            on(2)
        logs = []
        for i, p in enumerate(agents):
            try:
                _, err = p.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                kill_tree(p)
                _, err = p.communicate()
            logs.append(f"agent {i} exit {p.returncode}:\n{err[-4000:]}")
        text = "\n---\n".join(logs)
        survivors = agents[:2] if change == "leave" else agents
        assert [p.returncode for p in survivors] == [0] * len(survivors), text
    finally:
        for p in agents:
            kill_tree(p)
        hosts.close()
        assert leftover_namespaces(hosts.tag) == [], "namespaces left behind"
    records = [d for d in map(json.loads, log.read_text().splitlines()) if "data" in d]
    lines = [x for x in (samples.parse(d)[0] for d in records) if x is not None]
    return samples.final_history(lines), samples.judge(records), text


@pytest.mark.timeout(900)  # agents' start-ups take minutes on a loaded host; each wait has its deadline
@pytest.mark.parametrize("change, worlds", [("leave", (3, 2)), ("join", (2, 3))])
def test_a_node_lost_or_joining_mid_epoch_trains_each_sample_once(
        tmp_path: Path, change: str, worlds: tuple[int, int]) -> None:
    history, verdict, logs = _run(tmp_path, change)
    assert verdict.ok is True and verdict.epochs == tuple(range(EPOCHS)), f"{verdict.detail}\n{logs}"
    want = Counter(range(SAMPLES))
    for e in range(EPOCHS):
        got = Counter(i for x in history if x.epoch == e for i in x.indices + x.padding)
        assert got == want, (e, got - want, want - got)  # exactly: no padding either
    order = list(dict.fromkeys(x.run[1] for x in history))
    assert order == list(worlds), order  # the world changed once, as planned
    changed_in = {x.epoch for x in history if x.run[1] == worlds[1]} & \
        {x.epoch for x in history if x.run[1] == worlds[0]}
    assert changed_in, "the world size changed inside an epoch"

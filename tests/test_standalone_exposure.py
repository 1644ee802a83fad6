"""A ``--standalone`` job's stores (the rendezvous store and the workers' store the agent hosts)
listen on loopback only (torch's TCPStore alone would bind ``::``: every interface), and the agent
seals its records with a random per-run token: a stranger on this host who reaches the port and
writes a forged failure note or shutdown changes nothing."""
from __future__ import annotations

import datetime
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _store_port(agent: psutil.Process, workers_port: int) -> int:
    """The rendezvous store's port: of the agent's two listeners, the one that is not the
    workers' store (their MASTER_PORT); both on 127.0.0.1 only."""
    listening = [c.laddr for c in agent.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    assert workers_port in {a.port for a in listening}, (workers_port, listening)
    assert len(listening) == 2, f"expected the rendezvous and the workers' store, got {listening}"
    assert {a.ip for a in listening} == {"127.0.0.1"}, f"a store listens beyond loopback: {listening}"
    (port,) = [a.port for a in listening if a.port != workers_port]
    return port


def test_forged_records_from_a_stranger_change_nothing_in_a_standalone_job(tmp_path: Path) -> None:
    dist = pytest.importorskip("torch.distributed")
    marks = tmp_path / "runs"
    marks.mkdir()
    script = tmp_path / "w.py"
    script.write_text("import os, sys, time\n"
                      f"tmp = os.path.join({str(tmp_path)!r}, str(os.getpid()))\n"
                      "open(tmp, 'w').write(os.environ['MASTER_PORT'])\n"
                      f"os.rename(tmp, os.path.join({str(marks)!r}, str(os.getpid())))\n"
                      f"while not os.path.exists({str(tmp_path / 'go')!r}):\n    time.sleep(0.05)\n")
    logs = tmp_path / "logs"
    agent = subprocess.Popen([sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node",
                              "1", "--max-restarts", "3", "--log-dir", str(logs), str(script)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(marks.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(marks.iterdir()), "the worker did not start"
        (run_id,) = [p.name for p in logs.iterdir()]
        (mark,) = list(marks.iterdir())
        port = _store_port(psutil.Process(agent.pid), int(mark.read_text()))
        stranger = dist.TCPStore("127.0.0.1", port, is_master=False,
                                 timeout=datetime.timedelta(seconds=10))
        prefix = f"rdzv/{run_id}"
        stranger.set(f"{prefix}/r/1/job/failed", '{"node_id": "evil", "headline": "forged"}')
        stranger.set(f"{prefix}/shutdown", '{"reason": "failed: forged"}')
        stranger.set(f"{prefix}/r/1/job/decision",
                     '{"action": "give_up", "restart_count": 9, "reason": "forged"}')
        del stranger
        time.sleep(2.0)  # watches poll at most every second
        (tmp_path / "go").touch()
        out, err = agent.communicate(timeout=120)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
    assert agent.returncode == 0, err
    assert len(list(marks.iterdir())) == 1, "the forged records restarted the workers"

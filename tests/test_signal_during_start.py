"""SIGTERM to elastictk-run while it starts many workers is acted on at once (5 s allowed for a
loaded machine, against the minutes the remaining starts and the join timeout would take): the
rest are not started, those started are stopped, and the agent exits 128+15."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.helpers.procs import cmdline

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 200  # starting them all takes many seconds here; the test waits for the first few



def test_sigterm_while_the_group_starts_stops_it_at_once(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    marks = tmp_path / "started"
    marks.mkdir()
    script.write_text(f"import os, time; open(os.path.join({str(marks)!r}, str(os.getpid())), 'w').close(); "
                      "time.sleep(120)\n")
    agent = subprocess.Popen(
        [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", str(WORKERS),
         "--start-method", "spawn", "--log-dir", str(tmp_path / "logs"), str(script)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    try:
        me = psutil.Process(agent.pid)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until a few workers run
            kids = [c for c in me.children(recursive=True) if "w.py" in cmdline(c)]
            seen.update(c.pid for c in kids)
            if len(kids) >= 3:
                break
            time.sleep(0.02)
        assert len(seen) >= 3, "the workers did not start"
        sent = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=60)
        took = time.monotonic() - sent
        assert agent.returncode == 128 + signal.SIGTERM, err
        started = len(list(marks.iterdir()))
        assert started < WORKERS // 2, f"{started} of {WORKERS} workers started after the SIGTERM"
        assert took < 5, f"the agent went on for {took:.1f}s after SIGTERM"
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        for pid in seen:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_sigterm_while_waiting_for_other_nodes_ends_the_agent_at_once(tmp_path: Path) -> None:
    """A node waiting for peers that never come (--nnodes 2, one agent) acts on SIGTERM at once,
    not after the join timeout."""
    from elastictk.store import quiet_port

    script = tmp_path / "w.py"
    script.write_text("import time; time.sleep(120)\n")
    events = tmp_path / "events.jsonl"
    agent = subprocess.Popen(
        [sys.executable, "-m", "elastictk.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{quiet_port('127.0.0.1')}",
         "--rdzv-id", "lonely", "--event-log", str(events), "--log-dir", str(tmp_path / "logs"),
         str(script)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "rendezvous_started" not in (
                events.read_text() if events.exists() else ""):
            time.sleep(0.05)
        time.sleep(1.0)  # well inside the wait for the second node
        sent = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
    assert agent.returncode == 128 + signal.SIGTERM, err
    # Against the join timeout's 600 s: a loaded machine took 4.5 s to end a Python process.
    assert took < 15.0, f"the agent waited {took:.1f}s for the round after SIGTERM"


def test_sigterm_during_the_restart_backoff_ends_the_agent_at_once(tmp_path: Path) -> None:
    """--restart-backoff 30 after a failure: SIGTERM is acted on, not slept through."""
    script = tmp_path / "w.py"
    script.write_text("import sys; sys.exit(3)\n")
    events = tmp_path / "events.jsonl"
    agent = subprocess.Popen(
        [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "1",
         "--max-restarts", "3", "--restart-backoff", "30", "--event-log", str(events),
         "--log-dir", str(tmp_path / "logs"), str(script)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and '"restart"' not in (
                events.read_text() if events.exists() else ""):
            time.sleep(0.05)
        assert '"restart"' in events.read_text(), "the worker's failure was not restarted"
        sent = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
    assert agent.returncode == 128 + signal.SIGTERM, err
    assert took < 3.0, f"the agent slept {took:.1f}s of its backoff after SIGTERM"


def test_sigterm_in_the_exit_barrier_ends_the_agent_at_once(tmp_path: Path) -> None:
    """Node A's worker finished, node B's runs on: A waits in the exit barrier, and SIGTERM ends
    that wait at once (exit 128+15), not after the barrier's timeout."""
    from elastictk.store import quiet_port

    fast, slow = tmp_path / "fast.py", tmp_path / "slow.py"
    fast.write_text("pass\n")
    slow.write_text("import time; time.sleep(60)\n")
    port = quiet_port("127.0.0.1")
    agents = {}
    for name, script in (("a", fast), ("b", slow)):
        agents[name] = subprocess.Popen(
            [sys.executable, "-m", "elastictk.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "barrier",
             "--event-log", str(tmp_path / f"{name}.jsonl"), "--log-dir", str(tmp_path / name),
             "--rdzv-conf", "last_call_timeout=1", str(script)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # Node a runs the script that ends at once: once its workers started, it soon waits in
        # the exit barrier for b, whose worker sleeps.
        deadline = time.monotonic() + 120
        while not _started(tmp_path / "a.jsonl") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _started(tmp_path / "a.jsonl"), "node a did not start its workers"
        time.sleep(1.5)
        assert agents["a"].poll() is None and agents["b"].poll() is None
        waiting = "a"
        agent = agents[waiting]
        sent = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=60)
        took = time.monotonic() - sent
        assert agent.returncode == 128 + signal.SIGTERM, err
        assert took < 3.0, f"the agent waited {took:.1f}s in the exit barrier after SIGTERM"
    finally:
        for p in agents.values():
            if p.poll() is None:
                p.kill()
            p.communicate()


def _started(events: Path) -> bool:
    return events.exists() and '"workers_started"' in events.read_text()


def test_ctrl_c_before_the_agent_runs_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """Ctrl-C while elastictk-run starts (here: waiting for a store host that never comes, before
    the agent has taken SIGINT over) was a 30-line KeyboardInterrupt traceback from wherever it
    landed (an import, the store wait); it is one line, exit 130, and nothing is left running."""
    script = tmp_path / "w.py"
    script.write_text("print('trained')\n")
    agent = subprocess.Popen(
        [sys.executable, "-m", "elastictk.run", "--rdzv-backend", "c10d", "--rdzv-endpoint",
         "127.0.0.1:1", "--nnodes", "2", "--rdzv-conf", "is_host=false,read_timeout=300", str(script)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as an interactive shell's
    try:
        assert agent.stderr is not None
        first = agent.stderr.readline()  # the event: it is waiting, well inside its start
        assert "waiting up to 300s for the store at 127.0.0.1:1" in first, first
        kids = psutil.Process(agent.pid).children(recursive=True)
        agent.send_signal(signal.SIGINT)
        out, err = agent.communicate(timeout=120)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert agent.returncode == 130, (agent.returncode, err[-3000:])
    assert err.splitlines() == ["elastictk-run: interrupted (Ctrl-C) while starting; the job did not run"], err
    assert "trained" not in out
    psutil.wait_procs(kids, timeout=60)
    assert not [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE], kids

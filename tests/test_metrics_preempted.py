"""A job stopped by its pre-emption signal ends in ``elastictk_agent_state{state="preempted"}``,
neither failed nor succeeded nor a plain "signalled": a dashboard or an alert can tell a job the
scheduler will requeue from one that broke.

End to end: a real ``elastictk-run`` under a faked Slurm job (its variables, one node at
127.0.0.1) gets its ``--preempt-signal``; its exporter is scraped until it exits. Its workers
ignore the signal, so the grace period (2 s) keeps the exporter up in its final state long
enough for the scrapes to see it. Unit level: the event that makes the state.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client import CollectorRegistry

from elastictk.agent.preempt import PREEMPTED_EXIT
from elastictk.metrics.agent_metrics import STATES, AgentMetrics
from elastictk.store import quiet_port
from tests.test_slurm_defaults import _free_job_id
from tests.test_slurm_preempt import _env, _wait_for

ROOT = Path(__file__).resolve().parent.parent


def _states(body: str) -> dict[str, float]:
    """``elastictk_agent_state``'s value per ``state`` label in one scrape."""
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith("elastictk_agent_state{"):
            labels, value = line.rsplit(" ", 1)
            state = labels.split('state="', 1)[1].split('"', 1)[0]
            out[state] = float(value)
    return out


def test_preempted_job_ends_in_the_preempted_state(tmp_path: Path) -> None:
    started, events, port = tmp_path / "started", tmp_path / "events.jsonl", quiet_port()
    script = tmp_path / "w.py"
    script.write_text("import signal, time\nsignal.signal(signal.SIGUSR2, signal.SIG_IGN)\n"
                      f"open({str(started)!r}, 'w').close()\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-m", "elastictk.run", "--preempt-signal", "USR2",
                             "--grace-period", "2", "--metrics-port", str(port), "--event-log", str(events),
                             str(script)], cwd=ROOT, env=_env(_free_job_id()), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/metrics"
    scrapes: list[dict[str, float]] = []
    try:
        _wait_for(started, lambda _: True, proc)
        proc.send_signal(signal.SIGUSR2)
        while proc.poll() is None:  # scrape until the exporter is gone with its agent
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    scrapes.append(_states(r.read().decode()))
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == PREEMPTED_EXIT, err
    last = scrapes[-1]
    assert last["preempted"] == 1 and sum(last.values()) == 1, (last, err)  # failed, succeeded: 0
    assert set(last) == set(STATES)
    ends = [e for e in map(json.loads, events.read_text().splitlines()) if e["kind"] == "signalled"]
    assert len(ends) == 1 and ends[0]["fields"] == {"signal": "SIGUSR2", "preempted": True}, ends


def test_the_signalled_event_sets_preempted_only_when_it_says_so() -> None:
    for fields, state in (({"signal": "SIGUSR1", "preempted": True}, "preempted"),
                          ({"signal": "SIGTERM"}, "signalled"),
                          ({"signal": "SIGTERM", "preempted": "yes"}, "signalled")):  # not a bool: no
        m = AgentMetrics(CollectorRegistry(), job="r1", node="n0")
        m("workers_started", attempt=0, restart_count=0, pids={0: 1})
        m("signalled", **fields)
        assert m.current_state == state
        values = {s: m.registry.get_sample_value("elastictk_agent_state", {
            "run_id": "r1", "node": "n0", "role": "default", "state": s}) for s in STATES}
        assert values == {s: float(s == state) for s in STATES}

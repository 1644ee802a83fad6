"""``elastictk-run --collective-timeout``: the agent's watchdog turns a frozen peer into a restart.

The same three-rank gloo job as test_timer_collectives.py (rank 2 SIGSTOPs itself in the first
attempt, ranks 0 and 1 hang in all_reduce), but launched by the real CLI with its default start
method (workers forked from the preload server, where no sitecustomize runs), so this checks the
whole path: flag → worker environment → collectives under timers → reaper → agent events,
restart, and the failure summary naming where each rank was stuck.
"""
from __future__ import annotations

import re
from pathlib import Path

from elastictk.metrics.events import read_events
from tests.test_run import run
from tests.test_timer_collectives import TRAIN, _line

STUCK = re.compile(r"rank ([01]) stuck in (all_reduce|wait\(allreduce\)) at train\.py:(\d+)")


def _launch(tmp_path: Path, max_restarts: int):  # type: ignore[no-untyped-def]
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    events = tmp_path / "events.jsonl"
    r = run("--standalone", "--nproc-per-node", "3", "--max-restarts", str(max_restarts),
            "--collective-timeout", "4", "--shutdown-timeout", "1",
            "--log-dir", str(tmp_path / "logs"), "--event-log", str(events), str(script),
            timeout=180)
    return r, [{"event": e.kind, **e.fields} for e in read_events(events)]


def _expected_line(rank: str) -> int:
    return _line("RANK 0 STUCK" if rank == "0" else "RANK 1 STUCK")


def test_a_frozen_peer_is_caught_by_collective_timers_and_the_job_restarts(tmp_path: Path) -> None:
    r, events = _launch(tmp_path, max_restarts=1)
    assert r.returncode == 0, r.stderr[-3000:]
    expired = [e for e in events if e["event"] == "timer_expired"]
    # Both stuck ranks' timers run out together; on a loaded machine the second may instead see
    # gloo fail once the first is killed. Either way every expiry names a stuck rank correctly.
    assert expired and {e["local_rank"] for e in expired} <= {0, 1}, expired
    scopes = {0: "all_reduce", 1: "wait(allreduce)"}
    assert all(e["scope"] == scopes[e["local_rank"]] for e in expired), expired
    for e in expired:
        assert e["where"] == f"train.py:{_expected_line(str(e['rank']))} (main)"
        report = Path(e["report"])
        assert report.parent.parent.name == "attempt_0" and e["where"] in report.read_text()
    failed = [e for e in events if e["event"] == "worker_failed"]
    assert failed and failed[0]["cause"] == "timer_expired", failed
    assert [e["restart_count"] for e in events if e["event"] == "restart"] == [1]
    assert r.stdout.count("finished") == 3, r.stdout  # only the restarted attempt gets there


def test_without_restarts_the_summary_says_where_the_rank_was_stuck(tmp_path: Path) -> None:
    r, _ = _launch(tmp_path, max_restarts=0)
    assert r.returncode == 1, r.stderr[-3000:]
    found = STUCK.findall(r.stderr)
    assert found, r.stderr[-3000:]
    rank, _scope, line = found[0]
    assert int(line) == _expected_line(rank)
    assert "watchdog timer expired" in r.stderr and "timer_expired.txt" in r.stderr

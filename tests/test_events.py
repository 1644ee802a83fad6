"""The JSON-lines event log: what it writes, that it only ever appends, and reading it back."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastictk.metrics.events import EventLog, EventLogError, event_log_path, iter_events, read_events

ROOT = Path(__file__).resolve().parent.parent


def test_one_line_per_event_with_envelope_and_fields(tmp_path: Path) -> None:
    path = event_log_path(tmp_path, "job1")
    with EventLog(path, run_id="job1", node_id="n0") as log:
        log("round_joined", round=0, rank=0, world=2)
        log("workers_started", attempt=0, restart_count=0, pids={0: 11, 1: 12})
        log("worker_failed", rank=1, local_rank=1, exit="SIGKILL", first_in_job=True)
    assert path == tmp_path / "job1" / "events.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0])
    assert set(first) == {"seq", "kind", "time", "wall", "mono", "pid", "run_id", "node_id", "fields"}
    assert first["fields"] == {"round": 0, "rank": 0, "world": 2}
    assert first["pid"] == os.getpid() and first["time"].endswith("Z")
    events = read_events(path)
    assert [e.kind for e in events] == ["round_joined", "workers_started", "worker_failed"]
    assert [e.seq for e in events] == [1, 2, 3]
    assert all(e.run_id == "job1" and e.node_id == "n0" for e in events)
    assert events[1].get("pids") == {"0": 11, "1": 12}  # JSON keys are strings
    assert events[2].get("exit") == "SIGKILL"
    monos = [e.mono for e in events]
    assert monos == sorted(monos)
    assert read_events(path, kinds={"worker_failed"})[0].get("rank") == 1


def test_appends_and_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    for attempt in range(3):
        with EventLog(path, run_id="r") as log:
            log("workers_started", attempt=attempt)
    assert [e.get("attempt") for e in read_events(path)] == [0, 1, 2]


def test_each_line_is_on_disk_as_soon_as_it_is_logged(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    log = EventLog(path)
    try:
        log("restart", restart_count=1, delay_s=0.0, reason="x")
        # another reader sees the line before the log is closed or flushed by hand
        assert [e.kind for e in read_events(path)] == ["restart"]
    finally:
        log.close()


def test_without_a_path_events_wait_for_the_run_directory(tmp_path: Path) -> None:
    log = EventLog(run_id="job")
    try:
        log("round_joined", round=0, rank=0, world=1, node_id="node-a")
        assert log.path is None
        run_dir = tmp_path / "logs" / "job"
        log("workers_started", attempt=0, restart_count=0, pids={}, run_dir=str(run_dir))
        log("job_finished", restarts=0)
    finally:
        log.close()
    events = read_events(run_dir / "events.jsonl")
    assert [e.kind for e in events] == ["round_joined", "workers_started", "job_finished"]
    assert events[0].mono <= events[1].mono  # held events keep the time they happened
    assert events[2].node_id == "node-a"  # a node_id field becomes the context of later lines


def test_attach_keeps_the_first_file(tmp_path: Path) -> None:
    with EventLog() as log:
        log("a")
        first = log.attach(tmp_path / "one.jsonl")
        assert log.attach(tmp_path / "two.jsonl") == first
        log("b")
    assert [e.kind for e in read_events(first)] == ["a", "b"]
    assert not (tmp_path / "two.jsonl").exists()


def test_values_json_cannot_hold_are_written_plainly(tmp_path: Path) -> None:
    class Odd:
        def __str__(self) -> str:
            return "odd"

    path = tmp_path / "e.jsonl"
    with EventLog(path) as log:
        log("x", where=tmp_path, ranks={2, 1}, ratio=math.nan, obj=Odd(), nested={"t": (1, 2)})
    (e,) = read_events(path)
    assert e.fields == {"where": str(tmp_path), "ranks": [1, 2], "ratio": "nan", "obj": "odd",
                        "nested": {"t": [1, 2]}}
    json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))


def test_unwritable_path_is_one_clear_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(EventLogError) as info:
        EventLog(blocker / "events.jsonl")
    msg = str(info.value)
    assert "\n" not in msg and str(blocker) in msg and "--event-log" in msg


def test_a_failing_disk_never_raises_into_the_agent(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with EventLog("/dev/full") as log:  # every write fails with ENOSPC
        log("restart", restart_count=1)
        log("restart", restart_count=2)
    warnings = [r for r in caplog.records if "not being recorded" in r.getMessage()]
    assert len(warnings) == 1


def test_reader_skips_a_torn_last_line_and_names_a_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    with EventLog(path) as log:
        log("a")
        log("b")
    with open(path, "ab") as f:
        f.write(b'{"seq": 3, "kind": "c", "fie')  # the writer was killed mid-line
    assert [e.kind for e in read_events(path)] == ["a", "b"]
    with open(path, "ab") as f:
        f.write(b"\n")
    with EventLog(path) as log:
        log("d")
    with pytest.raises(EventLogError, match=r"e\.jsonl:3: not an elastictk event"):
        read_events(path)
    with pytest.raises(EventLogError, match="cannot read event log"):
        read_events(tmp_path / "missing.jsonl")


TORN_WRITER = """
import os, signal, sys
from elastictk.metrics.events import EventLog
with EventLog(sys.argv[1], node_id="w") as log:
    log("first")
    log("second")
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)
os.write(fd, b'{"seq": 3, "kind": "third", "fields": {"ra')  # half of the next line, then killed
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_torn_last_line_from_a_killed_writer_is_skipped_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "events.jsonl"
    proc = subprocess.run([sys.executable, "-c", TORN_WRITER, str(path)], cwd=ROOT, timeout=60)
    assert proc.returncode == -9
    assert not path.read_bytes().endswith(b"\n")
    with caplog.at_level("WARNING", logger="elastictk.metrics"):
        assert [e.kind for e in read_events(path)] == ["first", "second"]
    torn = [r.getMessage() for r in caplog.records if "torn last line" in r.getMessage()]
    assert len(torn) == 1 and f"{path}:3" in torn[0] and "\n" not in torn[0]
    caplog.clear()
    with open(path, "ab") as f:  # another writer appends after it: now a corrupt line in the middle
        f.write(b"\n")
    with EventLog(path) as log:
        log("fourth")
    with pytest.raises(EventLogError, match=r"events\.jsonl:3: not an elastictk event"):
        read_events(path)
    assert not [r for r in caplog.records if "torn" in r.getMessage()]
    whole = tmp_path / "whole.jsonl"  # a last line that parses counts, newline or not
    whole.write_bytes(b'{"seq": 1, "kind": "a"}\n{"seq": 2, "kind": "b", "fields": {}}')
    assert [e.kind for e in read_events(whole)] == ["a", "b"]


WRITER = """
import sys
from elastictk.metrics.events import EventLog
with EventLog(sys.argv[1], node_id=sys.argv[2]) as log:
    for i in range(300):
        log("tick", i=i, pad="x" * 300)
"""


def test_two_processes_appending_interleave_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "shared.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), f"w{n}"], cwd=ROOT) for n in range(2)]
    for p in procs:
        assert p.wait(timeout=60) == 0
    events = read_events(path)
    assert len(events) == 600
    for writer in ("w0", "w1"):
        assert [e.get("i") for e in events if e.node_id == writer] == list(range(300))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.text(min_size=1, max_size=16),
                          st.dictionaries(st.from_regex(r"[a-z_]{1,10}", fullmatch=True), json_values, max_size=5)),
                max_size=8))
def test_any_json_fields_round_trip(tmp_path_factory: pytest.TempPathFactory,
                                    batch: list[tuple[str, dict[str, object]]]) -> None:
    path = tmp_path_factory.mktemp("rt") / "events.jsonl"
    with EventLog(path) as log:
        for kind, fields in batch:
            log(kind, **fields)
    got = list(iter_events(path))
    assert [(e.kind, e.fields) for e in got] == batch

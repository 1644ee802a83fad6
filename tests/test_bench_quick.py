"""The benchmarks run, report sensibly and clean up; their numbers are never asserted on."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

import bench
from bench.common import (
    BenchResult, Comparison, Measured, Stats, interleaved, markdown_table, ratio, ratio_text,
)
from tests.helpers.netns import leftover_namespaces

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = st.lists(st.floats(min_value=1e-6, max_value=1e9), min_size=1, max_size=40)


def _bench(*args: str, tmp: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TMPDIR": str(tmp)}  # every temp file of the run lands in tmp
    return subprocess.run(
        [sys.executable, "-m", "bench", *args], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=timeout,
    )


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path: the benchmark's client pool starts multiprocessing's fork
    server, whose AF_UNIX socket lives under TMPDIR, and a socket path may have 107 bytes at
    most (a pytest-xdist tmp_path left 2 to spare, or none)."""
    d = Path(tempfile.mkdtemp(prefix="etb-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _results_snapshot() -> dict[str, float]:
    d = ROOT / "bench" / "results"
    return {p.name: p.stat().st_mtime for p in d.iterdir()} if d.is_dir() else {}


def test_quick_run_reports_every_store_pair_and_leaves_nothing_behind(tmp_path: Path, short_tmp: Path) -> None:
    work = short_tmp
    out = tmp_path / "out.json"
    before = _results_snapshot()
    proc = _bench("store", "--quick", "--json", str(out), tmp=work, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]

    data = json.loads(out.read_text())
    assert data["quick"] is True
    store = data["benchmarks"]["store"]
    assert store["unit"] == "ops/s" and store["higher_is_better"] is True
    assert {"cpu_model", "cores", "python", "torch"} <= set(store["machine"])
    rows = store["rows"]
    seen = {(r["case"]["op"], r["case"]["clients"], r["elastictk"]["label"]) for r in rows}
    for op in ("set", "get", "add"):
        for clients in ("1", "4"):
            assert (op, clients, "TCPStore") in seen
    for r in rows:
        assert r["elastictk"]["median"] > 0 and r["reference"]["median"] > 0
        assert r["elastictk"]["n"] == r["reference"]["n"] == 3
        assert ("faster" in r["summary"]) != ("slower" in r["summary"])
    # A store that is not there yet is skipped with a note, never silently.
    labels = {r["elastictk"]["label"] for r in rows}
    for label, module in (("FileStore", "file"), ("EtcdStore", "etcd")):
        if not any(got.startswith(label) for got in labels):
            assert any(f"elastictk.store.{module}" in n or label in n for n in store["notes"])

    # The table went to stdout; nothing went to bench/results in quick mode.
    assert "| op | clients | elastictk |" in proc.stdout
    assert _results_snapshot() == before
    # Every helper process (clients, forkserver, etcd) is gone, and so are the temp files.
    procs = []
    for pid in store["pids"]:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, f"benchmark left processes behind: {alive}"
    assert list(work.iterdir()) == []


def test_unknown_benchmark_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = _bench("no-such-bench", tmp=tmp_path, timeout=60)
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert "\n" not in err and "no-such-bench" in err and "store" in err


def test_registry_lists_benchmarks_not_helpers() -> None:
    names = bench.available()
    assert "store" in names
    assert not {"common", "__main__", "_pool"} & set(names)
    assert callable(bench.load("store").run)
    with pytest.raises(ValueError, match="unknown benchmark"):
        bench.load("common")


@given(SAMPLES)
def test_stats_are_ordered(xs: list[float]) -> None:
    s = Stats.of(xs)
    assert s.min <= s.q1 <= s.median <= s.q3 <= s.max
    assert s.n == len(xs) and s.min == min(xs) and s.max == max(xs)


@given(SAMPLES, SAMPLES, st.booleans())
def test_ratio_says_who_is_better(a: list[float], b: list[float], higher: bool) -> None:
    ours, ref = Stats.of(a), Stats.of(b)
    r = ratio(ours, ref, higher)
    better = ours.median > ref.median if higher else ours.median < ref.median
    text = ratio_text(ours, ref, higher)
    if better:
        assert r > 1 and "faster" in text
    elif ours.median != ref.median:
        assert r < 1 and "slower" in text
    assert ratio(ref, ours, higher) == pytest.approx(1 / r)


@given(st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=5, unique=True),
       st.integers(1, 7))
def test_interleaving_alternates_direction(subjects: list[str], rounds: int) -> None:
    calls: list[str] = []
    out = interleaved(subjects, lambda s: calls.append(s) or float(len(calls)), rounds)
    assert all(len(v) == rounds for v in out.values())
    expected: list[str] = []
    for r in range(rounds):
        expected += subjects if r % 2 == 0 else subjects[::-1]
    assert calls == expected


def test_table_marks_the_reference_note_and_noise() -> None:
    ours, theirs = Measured("ours", [10, 11, 12]), Measured("theirs", [11, 12, 13])
    row = Comparison({"op": "get"}, ours, theirs, note="no counterpart")
    other = Comparison({"op": "set"}, Measured("ours", [30]), Measured("theirs", [10]),
                       note="other")
    result = BenchResult("x", "X", "", "ops/s", True, [row, other])
    table = markdown_table(result)
    assert "theirs ¹" in table and "¹ no counterpart" in table
    assert "theirs ²" in table and "² other" in table
    assert ("| get | ours | 11 [10.5–11.5] | theirs ¹ | 12 [11.5–12.5] | "
            "×1.09 slower (IQRs overlap) |") in table
    assert "| set | ours | 30 [30–30] | theirs ² | 10 [10–10] | ×3.00 faster |" in table


def test_quick_multinode_recovers_on_test_hosts_and_leaves_nothing_behind(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "out.json"
    proc = _bench("multinode", "--quick", "--json", str(out), tmp=work, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())["benchmarks"]["multinode"]
    assert any("recovered in" in n for n in data["notes"]), data["notes"]
    assert data["pids"], "the helper processes are listed"
    _, alive = psutil.wait_procs([p for p in map(_proc, data["pids"]) if p is not None], timeout=10)
    assert not alive, f"benchmark left processes behind: {alive}"
    tags = data["params"]["host_tags"]
    assert tags, "the benchmark names the test hosts it made"
    # its own namespaces by tag: another test may be making hosts of its own meanwhile
    assert [leftover_namespaces(t) for t in tags] == [[] for _ in tags], "the test hosts' namespaces are gone"
    assert list(work.iterdir()) == []


def _proc(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _quick(name: str, tmp_path: Path, timeout: float) -> dict:
    """``python -m bench NAME --quick``: exit 0, nothing in bench/results, no process or temp
    file left; the benchmark's JSON."""
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "out.json"
    before = _results_snapshot()
    proc = _bench(name, "--quick", "--json", str(out), tmp=work, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())["benchmarks"][name]
    assert _results_snapshot() == before
    assert data["pids"], "the launchers it started are listed"
    _, alive = psutil.wait_procs([p for p in map(_proc, data["pids"]) if p is not None], timeout=10)
    assert not alive, f"benchmark left processes behind: {alive}"
    assert list(work.iterdir()) == []
    return data


def test_quick_stragglers_names_the_slow_rank_and_no_one_in_the_control(tmp_path: Path) -> None:
    data = _quick("stragglers", tmp_path, timeout=240)
    [row] = data["rows"]
    assert row["case"] == {"slowdown": "4x", "named": "1/1"}
    assert 0 < row["elastictk"]["median"] < 6 * 0.5, "named within the watched windows"
    assert row["elastictk"]["extra"]["slowdown"][0] >= 1.5
    notes = " ".join(data["notes"])
    assert "none (control): named nobody in 1 of 1 runs" in notes
    assert "cost, 8 node(s): 8 sealed writes (one per node) and 8 reads" in notes


def test_quick_spares_recovers_with_and_without_a_spare(tmp_path: Path) -> None:
    data = _quick("spares", tmp_path, timeout=300)
    [row] = data["rows"]
    assert row["elastictk"]["extra"]["world_after"] == [2], "the spare brought the world back to 2"
    assert row["elastictk"]["median"] > 0 and row["reference"]["median"] > 0
    assert any("with a spare every rank of the 2-node job steps" in n for n in data["notes"])


def test_quick_peer_run_compares_the_transport_with_raw_tcp(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    proc = _bench("peer", "--quick", "--json", str(out), tmp=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["benchmarks"]["peer"]["rows"]
    assert [r["reference"]["label"] for r in rows] == ["raw loopback TCP"]
    assert rows[0]["elastictk"]["median"] > 0 and rows[0]["reference"]["median"] > 0

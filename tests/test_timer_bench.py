"""The timer benchmark's quick mode runs, reports every pair, and leaves nothing behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def test_quick_timer_benchmark_reports_cost_and_latency_and_cleans_up(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "out.json"
    results = ROOT / "bench" / "results"
    before = {p.name: p.stat().st_mtime for p in results.iterdir()}
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "timer", "--quick", "--json", str(out)], cwd=ROOT,
        env={**os.environ, "TMPDIR": str(work)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())["benchmarks"]["timer"]
    assert data["higher_is_better"] is False
    rows = {(r["case"]["measure"], r["case"]["form"], r["reference"]["label"]): r
            for r in data["rows"]}
    for form, suffix in (("with", " (with)"), ("calls", " acquire/release")):
        for ref in ("LocalTimerClient", "FileTimerClient"):
            row = rows[("cost", form, ref + suffix)]
            assert row["elastictk"]["extra"]["failed_pairs"] == 0
            assert row["elastictk"]["extra"]["pairs"] > 0
    for ref in ("LocalTimerServer", "FileTimerServer"):
        assert rows[("latency", "-", ref)]["elastictk"]["n"] == 3
    for r in data["rows"]:
        assert r["elastictk"]["median"] > 0 and r["reference"]["median"] > 0
        assert ("faster" in r["summary"]) != ("slower" in r["summary"])
    assert "| measure | form | server interval |" in proc.stdout
    assert {p.name: p.stat().st_mtime for p in results.iterdir()} == before
    procs = []
    for pid in data["pids"]:
        try:
            p = psutil.Process(pid)
            if "bench" in " ".join(p.cmdline()):  # not a stranger that reused the PID
                procs.append(p)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, f"benchmark left processes behind: {alive}"
    assert list(work.iterdir()) == []

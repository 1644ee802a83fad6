"""``chaos-timeline.png`` drawn with matplotlib from a recorded chaos run, and skipped in one
line where matplotlib is missing (the report is written either way).

The recorded run (``tests/data/chaos-inplace``) is a real ``elastictk-chaos --seed 3 --faults 3
--kinds sigkill,exit:3,sigsegv --recovery in-place`` run of ``examples/train_inplace.py`` with
4 workers: its report, event log and the workers' fault log, as elastictk-chaos wrote them.
"""
from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from elastictk.chaos.timeline import lanes_of, record_from_dir

RECORDED = Path(__file__).resolve().parent / "data" / "chaos-inplace"


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_the_recorded_run_reads_back_as_lanes_faults_and_recoveries() -> None:
    rec, world, seed = record_from_dir(RECORDED)
    assert (world, seed, rec.nodes, rec.exit_code) == (4, 3, 1, 0)
    lanes = lanes_of(rec, world)
    assert lanes.labels == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert sorted((lane, text) for lane, _, text in lanes.faults) == \
        [(0, "sigsegv rank:0"), (0, "sigsegv rank:0"), (3, "sigsegv rank:3")]
    # three in-place recoveries (rank 3 once, rank 0 twice), no restart of the whole job
    assert sorted(lane for lane, _, _ in lanes.inplace) == [0, 0, 3] and lanes.restarts == []
    assert all(0 <= failed <= formed <= lanes.span for _, failed, formed in lanes.inplace)
    # each replaced rank's bar is cut at its failure and goes on with the replacement
    assert sorted(lane for lane, _, _ in lanes.bars) == [0, 0, 0, 1, 2, 3, 3]
    assert sorted((lane, text) for lane, _, text in lanes.steps) == [(r, "step 29") for r in range(4)]


def test_the_picture_is_a_png_of_sensible_size_and_redraws_from_a_report_dir(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    where = tmp_path / "run"
    shutil.copytree(RECORDED, where)
    r = subprocess.run([sys.executable, "-m", "elastictk.chaos.timeline", str(where)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.strip() == f"timeline in {where / 'chaos-timeline.png'}"
    data = (where / "chaos-timeline.png").read_bytes()
    width, height = png_size(data)
    assert 1000 <= width <= 2000 and 250 <= height <= 1000, (width, height)
    assert len(data) > 15_000, "a picture with lanes, markers, labels and a legend"
    bad = subprocess.run([sys.executable, "-m", "elastictk.chaos.timeline", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "chaos-report.json" in bad.stderr


def test_without_matplotlib_one_line_says_the_picture_was_skipped(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None  # as if not installed: import raises ImportError\n"
        "from pathlib import Path\n"
        "from elastictk.chaos.timeline import record_from_dir, write_timeline\n"
        f"rec, world, seed = record_from_dir(Path({str(RECORDED)!r}))\n"
        f"print(write_timeline(rec, Path({str(tmp_path / 'x.png')!r}), world, seed=seed))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("timeline skipped: matplotlib is not installed "
                                "(pip install 'elastictk[plots]')")
    assert not (tmp_path / "x.png").exists()


def test_the_last_label_says_steps_run_where_only_optimizer_steps_were_counted() -> None:
    """The automatic count restarts at 0 in every process: a job resumed from step 10 that
    ended at step 40 counted 30 optimizer steps in its last process. That is no step number,
    so the label says how many steps that process ran; a script's own step keeps "step N"."""
    from elastictk.chaos.record import RunRecord

    exit_line = {"progress": "exit", "node": 0, "attempt": 1, "monotonic": 9.0}
    rec = RunRecord(argv=[], started=0.0, ended=10.0, progress=[
        {**exit_line, "source": "auto", "step": 30, "rank": 0},
        {**exit_line, "source": "checkpoint", "step": 39, "rank": 1}])
    labels = sorted((lane, text) for lane, _, text in lanes_of(rec, 2).steps)
    assert labels == [(0, "30 steps run"), (1, "step 39")]

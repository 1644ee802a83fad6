"""Exactly-once data under in-place recovery: tests/helpers/data_inplace.py (DDP over
``elastictk.data``'s ``DataLoader`` with 2 workers and ``ElasticSampler`` in the ``State``,
driven by ``run_elastic``) under ``elastictk-run --recovery in-place``, rank 1 SIGKILLed by a
chaos plan as step 8 (mid-epoch 1) starts: the survivor rolls back, the replacement receives
the state (sampler position included) from it, and the step is redone.

One chaos run checks: the report's data invariant (from the runtime's records), the script's
own records (per step, the newest generation: every epoch's samples are the dataset exactly),
and the final weights, equal to a fault-free run's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch

from elastictk.chaos.samples import NAME as DATA_CHECK
from tests.helpers.chaosrun import chaos, report

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "helpers" / "data_inplace.py"
SAMPLES, EPOCHS, KILL = 44, 2, 7  # 6 steps an epoch; the fault fires before step 8 (the 2nd of epoch 1)
FLAGS = ("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--recovery", "in-place")


def _args(work: Path) -> list[str]:
    return [str(SCRIPT), "--record", str(work / "record.jsonl"), "--out", str(work / "w.pt"),
            "--samples", str(SAMPLES), "--epochs", str(EPOCHS)]


def _history(work: Path) -> tuple[dict[int, Counter[int]], set[int]]:
    """Per epoch, the indices of the final history (per step, the newest generation's lines);
    and the generations seen in it."""
    lines = [json.loads(x) for x in (work / "record.jsonl").read_text().splitlines()]
    newest = {}
    for r in lines:
        newest[r["step"]] = max(newest.get(r["step"], -1), r["gen"])
    epochs: dict[int, Counter[int]] = {}
    for r in lines:
        if r["gen"] == newest[r["step"]]:
            epochs.setdefault(r["epoch"], Counter()).update(r["indices"])
    return epochs, set(newest.values())


def test_a_rank_killed_mid_epoch_in_place_trains_every_sample_once_with_fault_free_weights(
        tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    ref.mkdir()
    proc = subprocess.run([sys.executable, "-m", "elastictk.run", *FLAGS, "--log-dir", str(ref / "logs"),
                           *_args(ref)], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    hit = tmp_path / "hit"
    hit.mkdir()
    plan = hit / "plan.json"
    plan.write_text(json.dumps({"schema": "elastictk.fault-plan/1", "faults": [
        {"kind": "sigkill", "target": "rank:1", "at_step": KILL}]}))
    proc = chaos(hit, "--plan", str(plan), *FLAGS, "--", *_args(hit))
    out = proc.stdout + proc.stderr
    checks = {c["name"]: c for c in report(hit)["checks"]}
    assert checks[DATA_CHECK]["ok"], checks[DATA_CHECK]
    assert checks[DATA_CHECK]["detail"].startswith(f"{EPOCHS} finished epoch(s) of {SAMPLES} samples")
    assert all(c["ok"] for c in checks.values()), out[-3000:]
    events = [json.loads(x) for x in (hit / "r" / "chaos-events.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events].count("inplace_recovery") == 1, out[-3000:]  # in place, once
    want = Counter(range(SAMPLES))
    for work in (ref, hit):
        epochs, gens = _history(work)
        assert sorted(epochs) == list(range(EPOCHS)) and all(epochs[e] == want for e in epochs), epochs
    assert gens == {0, 1}, "the step was redone in the next generation"
    got = torch.load(hit / "w.pt", weights_only=True)
    ref_w = torch.load(ref / "w.pt", weights_only=True)
    assert all(torch.equal(got[k], ref_w[k]) for k in ref_w), out[-3000:]

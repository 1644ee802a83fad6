"""Exactly-once data end to end: elastictk-run, 2 gloo ranks, DDP over a DataLoader with 2
workers (tests/helpers/data_train.py), a rank SIGKILLed mid-epoch under restart-all with
``--snapshot local``.

The verdict comes from what each rank trained: every rank records the indices of each step it
trained; the final history keeps, per (step, rank), the newest attempt's record (a step redone
after the restore counts once). In it every epoch's samples must be the dataset exactly (44
samples, batch 4 per rank: 5 whole global batches and a short one of 4, no padding), and the
weights a fault-free run's. The failing side: the same job with torch's DistributedSampler and
the epoch as its only data position replays the epoch it was in.

The kills come from a fault plan under ``elastictk-chaos`` (rank 1 SIGKILLed after its optimizer
step 9, before the commit), whose report judges the same invariant from the runtime's own
records (elastictk/data/record.py, elastictk/chaos/samples.py): ok with ElasticSampler, BROKEN
with DistributedSampler, naming the samples the script's own records show twice.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch

from elastictk.data import order
from elastictk.chaos.samples import NAME as DATA_CHECK
from tests.helpers.chaosrun import chaos, report

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "helpers" / "data_train.py"
SAMPLES, EPOCHS, KILL = 44, 2, 9  # 6 steps per epoch: step 9 is the 3rd of epoch 1


def launch(tmp: Path, tag: str, *args: str, flags: tuple[str, ...] = ("--snapshot", "local"),
           nproc: int = 2, ok: bool = True) -> tuple[str, Path]:
    work = tmp / tag
    work.mkdir()
    cmd = [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "1", *flags, "--log-dir", str(work / "logs"),
           str(SCRIPT), "--record", str(work / "record.jsonl"), "--out", str(work / "w.pt"),
           "--samples", str(SAMPLES), "--epochs", str(EPOCHS), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, out[-3000:]
    return out, work


def history(work: Path) -> tuple[dict[int, Counter[int]], set[int]]:
    """Per epoch, the multiset of indices in the final history; and the restarts seen."""
    final: dict[tuple[int, int], dict] = {}
    for line in (work / "record.jsonl").read_text().splitlines():
        r = json.loads(line)
        key = (r["step"], r["rank"])
        if key not in final or final[key]["restart"] <= r["restart"]:
            final[key] = r
    epochs: dict[int, Counter[int]] = {}
    for r in final.values():
        epochs.setdefault(r["epoch"], Counter()).update(r["indices"])
    return epochs, {r["restart"] for r in final.values()}


def under_chaos(tmp: Path, tag: str, *args: str) -> tuple[str, Path, dict]:
    """The job under elastictk-chaos with rank 1 SIGKILLed at step 9 (restart-all, --snapshot
    local); its own records, and the chaos report's data check."""
    work = tmp / tag
    work.mkdir()
    plan = work / "plan.json"
    plan.write_text(json.dumps({"schema": "elastictk.fault-plan/1", "faults": [
        {"kind": "sigkill", "target": "rank:1", "at_step": KILL}]}))
    proc = chaos(work, "--plan", str(plan), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                 "--snapshot", "local", "--", str(SCRIPT), "--record", str(work / "record.jsonl"),
                 "--out", str(work / "w.pt"), "--samples", str(SAMPLES), "--epochs", str(EPOCHS), *args)
    checks = {c["name"]: c for c in report(work)["checks"]}
    return proc.stdout + proc.stderr, work, checks


def test_a_rank_killed_mid_epoch_trains_every_sample_once_and_ends_with_fault_free_weights(
        tmp_path: Path) -> None:
    _, ref = launch(tmp_path, "ref")
    out, hit, checks = under_chaos(tmp_path, "kill")
    want = Counter(range(SAMPLES))
    for work in (ref, hit):
        epochs, _ = history(work)
        assert sorted(epochs) == list(range(EPOCHS))
        assert all(epochs[e] == want for e in epochs), (work.name, epochs)
    _, restarts = history(hit)
    assert restarts == {0, 1}, "the kill happened and the job went on"
    assert checks[DATA_CHECK]["ok"], checks[DATA_CHECK]
    assert checks[DATA_CHECK]["detail"].startswith(f"{EPOCHS} finished epoch(s) of {SAMPLES} samples")
    assert all(c["ok"] for c in checks.values()), out[-3000:]
    got = torch.load(hit / "w.pt", weights_only=True)
    ref_w = torch.load(ref / "w.pt", weights_only=True)
    assert all(torch.equal(got[k], ref_w[k]) for k in ref_w), out[-3000:]


def test_distributed_sampler_with_a_checkpoint_per_epoch_replays_the_epoch(tmp_path: Path) -> None:
    """The failing side, under the same plan: the epoch it was in is trained again from its
    start, so its samples before the kill appear twice in the final history; the chaos report
    says BROKEN and names them, from the runtime's records alone."""
    out, hit, checks = under_chaos(tmp_path, "ds", "--sampler", "distributed")
    epochs, restarts = history(hit)
    assert restarts == {0, 1}
    assert epochs[0] == Counter(range(SAMPLES))
    twice = epochs[1] - Counter(range(SAMPLES))
    assert sum(twice.values()) == 2 * 8, epochs[1]  # its 2 committed steps trained again
    data = checks[DATA_CHECK]
    assert not data["ok"] and data["detail"].startswith(
        "epoch 1: 16 sample(s) trained more than once (16 extra): "), data
    named = data["detail"].split(": ", 2)[2].split(", ")[:12]
    assert [int(i) for i in named] == sorted(twice)[:12]  # the samples the script saw twice
    assert [c["name"] for c in checks.values() if not c["ok"]] == [DATA_CHECK], out[-3000:]
    assert f"[BROKEN] {DATA_CHECK}: epoch 1: 16 sample(s)" in out


def test_relaunched_from_disk_at_three_ranks_takes_the_rest_of_the_epoch_once(tmp_path: Path) -> None:
    """Disk tier across a world-size change: 2 ranks, rank 1 killed mid-epoch with no restart
    left (the job fails); relaunched with 3 ranks on the same --snapshot-dir, the rest of the
    epoch is cut into global batches of 12: nothing trained before is taken again, nothing is
    left out; only the short last batch is padded (fewer than 3, from the epoch's start)."""
    disk = ("--snapshot", "disk", "--snapshot-dir", str(tmp_path / "ckpt"), "--snapshot-every", "2",
            "--max-restarts", "0")
    launch(tmp_path, "first", "--kill", str(KILL), flags=disk, ok=False)
    out, second = launch(tmp_path, "second", flags=disk, nproc=3)
    later = [json.loads(x) for x in (second / "record.jsonl").read_text().splitlines()]
    resumed = min(r["step"] for r in later)
    assert 1 < resumed <= KILL and {r["world"] for r in later} == {3}, out[-3000:]
    earlier = [json.loads(x) for x in (tmp_path / "first" / "record.jsonl").read_text().splitlines()]
    epochs: dict[int, Counter[int]] = {}
    for r in [r for r in earlier if r["step"] < resumed] + later:
        epochs.setdefault(r["epoch"], Counter()).update(r["indices"])
    want = Counter(range(SAMPLES))
    assert epochs[0] == want
    assert not want - epochs[1], "no sample of epoch 1 left out"
    extra = epochs[1] - want
    assert sum(extra.values()) < 3 and set(extra) <= set(order(SAMPLES, 1, 7, True)[:2]), extra

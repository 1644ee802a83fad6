"""The exactly-once data invariant (elastictk/chaos/samples.py) and the records it reads
(elastictk/data/record.py), in one process.

Properties: a simulated job (any dataset size, batch, world sizes, commit interval and failures,
each attempt resuming at its last commit, with ElasticSampler's cut) always passes; the same
records with one rolled-back step kept, one batch lost or a DistributedSampler-style replay of
the epoch always fail, naming the samples; garbage records never raise and never pass.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler, TensorDataset

from elastictk.chaos import samples
from elastictk.data import DataLoader, ElasticSampler, cut, record


def simulate(n: int, batch: int, worlds: list[int], fails: list[int], every: int,
             epochs: int, drop_last: bool) -> list[dict[str, Any]]:
    """The records of a job of ``epochs`` epochs over ``n`` samples: attempt ``a`` runs at world
    size ``worlds[a]`` and fails after handing ``fails[a]`` steps (the last attempt runs to the
    end); it resumes from the last commit (every ``every`` steps), as State.restore() does."""
    out: list[dict[str, Any]] = []
    committed = (0, 0, 0)  # (step, epoch, position)
    for attempt, world in enumerate(worlds):
        step, epoch, position = committed
        base = step
        budget = fails[attempt] if attempt < len(worlds) - 1 else 10**9
        handed = 0
        while epoch < epochs and handed < budget:
            cuts = [cut(n, position, batch, r, world, drop_last) for r in range(world)]
            for k in range(len(cuts[0].batches)):
                if handed >= budget:
                    break
                step += 1
                handed += 1
                for r, c in enumerate(cuts):
                    offs = c.batches[k]
                    out.append({"data": "batch", "epoch": epoch, "step": step, "attempt": attempt,
                                "world": world, "base": base,
                                "rank": r, "samples": n, "indices": [o for o in offs if o < n],
                                "padding": [o % n for o in offs if o >= n]})
                position = cuts[0].position_after(k + 1)
                if handed < budget and step % every == 0:
                    committed = (step, epoch, position)
            else:
                dropped = cuts[0].dropped
                for r in range(world):
                    out.append({"data": "end", "epoch": epoch, "step": step, "attempt": attempt,
                                "world": world, "base": base,
                                "rank": r, "samples": n, "dropped": list(range(n - dropped, n))})
                epoch, position = epoch + 1, 0
                if step % every == 0:
                    committed = (step, epoch, position)
                continue
            break
    return out


jobs = st.tuples(st.integers(1, 40), st.integers(1, 4), st.lists(st.integers(1, 4), min_size=1, max_size=4),
                 st.lists(st.integers(1, 12), min_size=4, max_size=4), st.integers(1, 3),
                 st.integers(1, 3), st.booleans())


@settings(max_examples=150, deadline=None)
@given(job=jobs)
def test_a_job_resumed_at_its_commits_passes_at_any_world_sizes(job: tuple) -> None:
    verdict = samples.judge(simulate(*job))
    assert verdict.ok is True, verdict.detail
    assert verdict.epochs == tuple(range(job[5]))


@settings(max_examples=100, deadline=None)
@given(job=jobs, pick=st.integers(0, 10**6))
def test_a_lost_batch_or_a_replayed_step_is_named(job: tuple, pick: int) -> None:
    """Planted faults in a passing history: one batch of the final history removed names its
    samples missing; the same batch trained again in a later step names them duplicated."""
    lines = simulate(*job)
    kept = samples.final_history([samples.parse(d)[0] for d in lines])  # type: ignore[misc]
    # an attempt's first step is where the judge sees it resume: lose a later one
    first = {a: min(d["step"] for d in lines if d["attempt"] == a) for a in {d["attempt"] for d in lines}}
    real = [x for x in kept if x.kind == "batch" and x.indices and x.step > first[x.attempt]]
    if not real:
        return
    victim = real[pick % len(real)]
    gone = [d for d in lines if not (d["data"] == "batch" and d["step"] == victim.step
                                    and d["rank"] == victim.rank and d["attempt"] == victim.attempt)]
    v = samples.judge(gone)
    assert v.ok is False and set(v.missing[victim.epoch]) >= set(victim.indices), v.detail
    last = max(d["step"] for d in lines)
    again = {**lines[-1], "data": "batch", "epoch": victim.epoch, "step": last + 1, "rank": 0,
             "indices": list(victim.indices), "padding": []}  # the last run trains them again
    v = samples.judge(lines + [again])
    assert v.ok is False and set(v.duplicated[victim.epoch]) == set(victim.indices), v.detail


def test_an_epoch_replayed_from_its_start_after_a_restore_is_broken() -> None:
    """DistributedSampler with a checkpoint per epoch: the attempt after the kill trains the
    epoch again from its start, from the step it restored (2 steps into the epoch)."""
    n, world, batch = 16, 2, 2  # 4 steps per epoch
    def steps(attempt: int, first_step: int, upto: int) -> list[dict[str, Any]]:
        out = []
        for k in range(upto):
            for r in range(world):
                ix = list(range(r, n, world))[k * batch:(k + 1) * batch]
                out.append({"data": "batch", "epoch": 0, "step": first_step + k, "attempt": attempt,
                            "world": world, "base": first_step - 1,
                            "rank": r, "samples": n, "indices": ix, "padding": []})
        return out
    ends = [{"data": "end", "epoch": 0, "step": 6, "attempt": 1, "world": world, "base": 2, "rank": r,
             "samples": n, "dropped": []}
            for r in range(world)]
    v = samples.judge(steps(0, 1, 3) + steps(1, 3, 4) + ends)  # step 3 killed, restored at 2
    assert v.ok is False
    assert v.duplicated == {0: {i: 1 for i in range(8)}} and not v.missing, v.detail
    assert v.detail.startswith("epoch 0: 8 sample(s) trained more than once (8 extra): 0, 1, 2")


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=20)
fields = st.fixed_dictionaries({}, optional={
    "data": st.sampled_from(["batch", "end", "off", "x"]) | json_values, "epoch": json_values | st.integers(-2, 3),
    "step": json_values | st.integers(-2, 9), "attempt": st.integers(-1, 2) | json_values,
    "world": st.integers(0, 3) | json_values, "base": st.integers(-2, 3) | json_values,
    "rank": st.integers(-1, 2) | json_values, "samples": st.integers(-1, 9) | json_values,
    "indices": st.lists(st.integers(-2, 10) | json_values, max_size=5) | json_values,
    "padding": json_values, "dropped": json_values, "why": json_values})


GOOD = simulate(13, 2, [3, 2], [4, 1, 1, 1], 2, 2, False)


@settings(max_examples=150, deadline=None)
@given(records=st.lists(fields | json_values, max_size=6))
def test_garbage_records_never_raise_and_never_pass(records: list[Any]) -> None:
    good = GOOD
    for mix in (records, good + records, records + good):
        v = samples.judge(mix)
        assert v.ok in (True, False, None) and v.detail
        if any(samples.parse(d)[0] is None for d in mix):
            assert v.ok is None and v.detail.startswith("unknown: ")


def test_no_records_or_no_finished_epoch_is_unknown_and_says_why() -> None:
    assert samples.MAX_SAMPLES == record.MAX_SAMPLES  # the judge reads what the workers write
    from bench._soak_matrix import DATA_CHECK

    assert DATA_CHECK == samples.NAME  # the soak's data scenario requires this check by name
    assert samples.judge([]).detail == "unknown: no batch was recorded"
    half = {"data": "batch", "epoch": 0, "step": 1, "attempt": 0, "world": 1, "base": 0, "rank": 0,
            "samples": 4, "indices": [0]}
    assert samples.judge([half]).detail == "unknown: no epoch finished in the run's final history"
    off = {"data": "off", "rank": 1, "why": "the dataset has 70000 samples, more than the 65536 recorded"}
    assert samples.judge([half, off]).detail.startswith("unknown: rank 1 recorded no batches: the dataset")
    lost = {**half, "step": None, "attempt": 1}
    assert "without State.restore() and outside run_elastic" in samples.judge([lost]).detail


def test_an_unknown_data_verdict_fails_the_reports_check() -> None:
    """The report's data check passes only on a verdict of True: a run whose only data record is
    "off" (the dataset too big to record) has no evidence, so its check fails, shown [UNKNOWN]
    (not judged, which is not [ok] and not [BROKEN] either)."""
    from elastictk.chaos import report
    from elastictk.chaos import rows as crows
    from elastictk.chaos.record import RunRecord
    from elastictk.faults import plan_of

    off = {"data": "off", "rank": 0, "why": "the dataset has 70000 samples, more than the 65536 recorded"}
    rec = RunRecord(argv=[], started=0.0, ended=1.0, exit_code=0, data=[off])
    plan = plan_of([])
    rows = crows.fault_rows(plan, rec)
    checks = report.check(plan, rec, rows, max_restarts=0)
    (data,) = [c for c in checks if c.name == samples.NAME]
    assert not data.ok and data.detail.startswith("unknown: rank 0 recorded no batches")
    text = report.render(rows, report.totals(rec, rows), checks)
    assert data.unknown and f"[UNKNOWN] {samples.NAME}: unknown" in text


# -- the worker side: what elastictk.data.DataLoader writes ---------------------------------

@pytest.fixture
def fault_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "faults.jsonl"
    monkeypatch.setenv(record.ENV_LOG, str(log))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    record._reset()
    yield log
    record._reset()


def _lines(log: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in log.read_text().splitlines()]


def test_loaders_record_each_batch_with_its_step_and_the_epoch_end(fault_log: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks of an ElasticSampler (10 samples, batch 2: a padded last global batch) and a
    DistributedSampler(drop_last) loader: the records of one epoch pass; a second pass of the
    same epoch by rank 0 (what a replay does) is named."""
    ds = TensorDataset(torch.arange(10))
    for rank in (0, 1):
        record._reset()
        monkeypatch.setenv("RANK", str(rank))
        sampler = ElasticSampler(ds, num_replicas=2, rank=rank, seed=3)
        for _ in DataLoader(ds, batch_size=2, sampler=sampler):
            pass
    got = _lines(fault_log)
    assert [d["step"] for d in got if d["rank"] == 0] == [1, 2, 3, 3]  # 3 batches, then the end
    assert samples.judge(got).ok is True, samples.judge(got).detail
    fault_log.unlink()
    for rank in (0, 1):
        record._reset()
        monkeypatch.setenv("RANK", str(rank))
        ds_sampler = DistributedSampler(ds, num_replicas=2, rank=rank, seed=3, drop_last=True)
        ds_sampler.set_epoch(1)
        for _ in DataLoader(ds, batch_size=2, sampler=ds_sampler, drop_last=True):
            pass
    got = _lines(fault_log)
    v = samples.judge(got)
    assert v.ok is True and sum(len(d["indices"]) for d in got if d["data"] == "batch") == 8, v.detail
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    for rank in (0, 1):  # restored at step 1, both ranks replay the epoch from its start
        monkeypatch.setenv("RANK", str(rank))
        record.resumed(1)
        ds_sampler = DistributedSampler(ds, num_replicas=2, rank=rank, seed=3, drop_last=True)
        ds_sampler.set_epoch(1)
        for _ in DataLoader(ds, batch_size=2, sampler=ds_sampler, drop_last=True):
            pass
    v = samples.judge(_lines(fault_log))
    first = [i for d in got if d["step"] == 1 and d["data"] == "batch" for i in d["indices"]]
    assert v.ok is False and v.duplicated == {1: {i: 1 for i in sorted(first)}}, v.detail
    assert v.detail.startswith("epoch 1: 4 sample(s) trained more than once (4 extra): ")

def test_nothing_is_recorded_outside_chaos_and_big_datasets_say_so(fault_log: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(record, "MAX_SAMPLES", 4)
    ds = TensorDataset(torch.arange(6))
    for _ in DataLoader(ds, batch_size=2, sampler=ElasticSampler(ds, num_replicas=1, rank=0)):
        pass
    for _ in DataLoader(ds, batch_size=2, shuffle=True):  # another sampler: not judged, no line
        pass
    (off,) = _lines(fault_log)
    assert off["data"] == "off" and "more than the 4 recorded" in off["why"]
    assert samples.judge([off]).ok is None
    fault_log.unlink()
    monkeypatch.delenv(record.ENV_LOG)
    for _ in DataLoader(ds, batch_size=2, sampler=ElasticSampler(ds, num_replicas=1, rank=0)):
        pass
    assert not fault_log.exists()


def test_a_soak_run_whose_report_never_judged_the_data_is_broken(tmp_path: Path) -> None:
    """The soak's data scenario requires the check: a report without it (recording silently
    off) counts as a broken invariant; with it, the verdict is tallied."""
    from bench._soak_matrix import SCENARIOS
    from bench._soak_tally import RunResult
    from bench.soak import Soak

    scenario = next(s for s in SCENARIOS if s.judged)
    soak = Soak(tmp_path, keep=True)
    for i, checks in enumerate(([{"name": "every planned fault fired", "ok": True}],
                                [{"name": samples.NAME, "ok": True, "detail": "1 finished epoch(s)"}])):
        (tmp_path / "chaos-report.json").write_text(json.dumps({"checks": checks}))
        r = RunResult(i, scenario.name, scenario.mode, scenario.script, 0, 0, 1.0)
        soak._judged(r, scenario, tmp_path)
        assert r.broken == ([] if i else [f"{samples.NAME}: not judged (the report holds no such check)"])
    assert soak.judged == {samples.NAME: [False, True]}


@settings(max_examples=60, deadline=None)
@given(junk=st.lists(st.binary(max_size=40) | st.sampled_from(
    [b"[" * 5000, b'{"data": NaN}', b"\xff\xfe{", b'{"data": "batch", "step": 1e999}', b"{" * 100]), max_size=5))
def test_the_fault_log_reader_survives_garbage_lines(junk: list[bytes], tmp_path_factory: Any) -> None:
    """The chaos runner reads the workers' fault log while they write it: lines of garbage
    (invalid UTF-8, deep nesting, NaN, huge numbers) are skipped, the good lines still read."""
    from elastictk.chaos.record import RunRecord, read_worker_records

    log = tmp_path_factory.mktemp("log") / "faults.jsonl"
    good = json.dumps(GOOD[0]).encode()
    log.write_bytes(b"\n".join([*junk, good, *junk]) + b"\n")
    rec = RunRecord(argv=[], started=0.0)
    read_worker_records(rec, log)
    assert GOOD[0] in rec.data

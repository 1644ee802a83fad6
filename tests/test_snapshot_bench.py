"""``python -m bench snapshot``'s own verdicts and flags (the timings themselves are not tested).

The benchmark's replica verdict is what says that no replica arrived torn while a job committed
every step; it must fail on a torn part and on a run in which nothing arrived whole.
"""
from __future__ import annotations

import pytest

from bench import _snap_memory, snapshot
from bench.__main__ import main as bench_main

MB = 10**6


def test_the_replica_verdict_passes_only_when_every_run_delivered_whole_parts_and_none_torn() -> None:
    ok = {100 * MB: {"memory": {"whole": 16, "torn": 0}, snapshot.PEER: {"whole": 44, "torn": 0}}}
    passed, line = snapshot.verdict(ok)
    assert passed and line.startswith("[ok]") and "100 MB memory 16 whole / 0 torn" in line
    torn = {**ok, 1000 * MB: {snapshot.PEER: {"whole": 7, "torn": 1}}}
    passed, line = snapshot.verdict(torn)
    assert not passed and line.startswith("[FAIL]") and "1000 MB local+peer, pipelined: 7 whole, 1 torn" in line
    passed, line = snapshot.verdict({10 * MB: {"memory": {"whole": 0, "torn": 0}}})
    assert not passed and "0 whole, 0 torn" in line
    assert not snapshot.verdict({})[0]


def test_fewer_samples_at_1_gb() -> None:
    assert snapshot._samples(100 * MB, quick=False) == (20, 5)
    assert snapshot._samples(1000 * MB, quick=False) == (5, 3)
    assert snapshot._samples(1000 * MB, quick=True) == (5, 3)


@pytest.mark.parametrize("value", ["7", "", "10,x", "1000,5"])
def test_sizes_other_than_10_100_1000_are_one_line_and_exit_2(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench_main(["snapshot", "--sizes", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give a comma list of 10, 100 and 1000" in err


def test_the_memory_table_names_peaks_lag_and_arrivals() -> None:
    m = {"state": 10 * MB, "snapshot": 40 * MB, "local": 20 * MB, "replicas": 20 * MB,
         "worker_anon": 237 * MB, "worker_shmem": 20 * MB, "agents_anon": 12 * MB, "node": 289 * MB,
         "lag_steps": 2, "arrivals": {"whole": 30, "torn": 0}}
    table = _snap_memory.table({10 * MB: m})
    row = table.splitlines()[-1]
    assert row == ("| 10 MB | 40 MB (4.00x) | 20 MB (2.00x) | 20 MB (2.00x) | 237 + 20 MB | 12 MB | "
                   "289 MB (28.90x) | 2 | 30 / 0 |")
    tight = {**m, "snapshot": 30 * MB, "replicas": 10 * MB, "node": 279 * MB, "arrivals": {"whole": 29, "torn": 0}}
    rows = _snap_memory.table({10 * MB: m}, {10 * MB: tight}).splitlines()[-2:]
    assert rows[0] == row and rows[1] == ("| 10 MB, one part | 30 MB (3.00x) | 20 MB (2.00x) | 10 MB (1.00x) | "
                                          "237 + 20 MB | 12 MB | 279 MB (27.90x) | 2 | 29 / 0 |")

"""Exactly-once data, judged from the workers' data records only (elastictk/data/record.py).

Each line names a batch a rank was handed (its dataset indices, the padding of the epoch's
short last global batch, the epoch, and the step it trains in, in the job's numbering), or the
end of an epoch on that rank (with the indices left out by design: ``drop_last``), or that the
rank's batches are not recorded (``off``, with why).

The run's *final history* is what the final weights were trained on. The job's *runs* (the
workers of one restart or membership change: the same restart count, world size and step
``State.restore()`` resumed at; under ``run_elastic`` one generation's restart count) are taken
in the order the lines were written (one fault log, appended to by every worker); a run resumes
after the step before its first recorded step, so every line of an earlier run at or past that
step was rolled back and is dropped (a step redone after a rollback counts once: per step
number, the last run that trained it). An epoch is
*finished* when its end is in the final history or a later epoch is. The invariant: in every
finished epoch each sample of the dataset, less those left out by design, was trained exactly
once (padding aside).

Pure: lines in, a :class:`Verdict` out; the records come from other processes, so every field
is checked and anything malformed makes the verdict unknown (never an exception, never a pass).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

NAME = "every sample of every finished epoch trained exactly once"
SHOWN = 12  # indices named per list in the verdict
MAX_SAMPLES = 65536  # elastictk.data.record.MAX_SAMPLES: a record naming a bigger dataset is not one


@dataclass(frozen=True)
class Line:
    """One checked data record."""

    kind: str            # "batch" | "end"
    epoch: int
    step: int
    attempt: int
    rank: int
    samples: int
    run: tuple[int, int, int]  # (attempt, world, base): the lines of one run of the job's workers
    indices: tuple[int, ...] = ()
    padding: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()


@dataclass(frozen=True)
class Verdict:
    """``ok`` True/False, or None when the records cannot tell (``detail`` says why)."""

    ok: Optional[bool]
    detail: str
    epochs: tuple[int, ...] = ()                    # the finished epochs judged
    duplicated: dict[int, dict[int, int]] = field(default_factory=dict)  # epoch -> index -> extra times
    missing: dict[int, tuple[int, ...]] = field(default_factory=dict)    # epoch -> indices never trained


def _int(v: Any, lo: int = 0) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) and lo <= v < 2**62 else None


def _ints(v: Any) -> Optional[tuple[int, ...]]:
    if not isinstance(v, list):
        return None
    out = tuple(_int(x) for x in v)
    return None if any(x is None for x in out) else out  # type: ignore[return-value]


def parse(d: Any) -> tuple[Optional[Line], str]:
    """One record, checked: (the line, "") or (None, what is wrong with it)."""
    if not isinstance(d, dict):
        return None, f"a record is {type(d).__name__}, not an object"
    kind = d.get("data")
    if kind == "off":
        why = d.get("why")
        return None, f"rank {d.get('rank')!r} recorded no batches: {why if isinstance(why, str) else '?'}"[:300]
    if kind not in ("batch", "end"):
        return None, f"a record's kind is {str(kind)[:40]!r}, not batch/end/off"
    epoch, attempt, rank, samples = (_int(d.get(k)) for k in ("epoch", "attempt", "rank", "samples"))
    if epoch is None or attempt is None or rank is None or samples is None or samples > MAX_SAMPLES:
        return None, f"a record lacks a whole epoch, attempt, rank or dataset size (<= {MAX_SAMPLES})"
    world, base = _int(d.get("world"), 1), _int(d.get("base"), -1)
    if world is None or base is None:
        return None, f"rank {rank}'s record names no world size or resumed step"
    step = _int(d.get("step"))
    if step is None:
        return None, (f"rank {rank} in attempt {attempt} recorded batches with no step: it resumed "
                      "without State.restore() and outside run_elastic, so which steps it redid is "
                      "not known")
    lists = {k: _ints(d.get(k, [])) for k in ("indices", "padding", "dropped")}
    bad = [k for k, v in lists.items() if v is None or any(i >= samples for i in v)]
    if bad:
        return None, f"rank {rank}'s record holds {bad[0]} that are not indices of {samples} samples"
    return Line(kind, epoch, step, attempt, rank, samples, (attempt, world, base), lists["indices"] or (),
                lists["padding"] or (), lists["dropped"] or ()), ""


def final_history(lines: Sequence[Line]) -> list[Line]:
    """The lines the final weights were trained on (see the module's docstring)."""
    kept: list[Line] = []
    for run in dict.fromkeys(x.run for x in lines):  # in the order the runs first wrote
        mine = [x for x in lines if x.run == run]
        if kept:  # this run resumed at the step before its first batch (or at its first end)
            resumed = min(x.step - 1 if x.kind == "batch" else x.step for x in mine)
            kept = [x for x in kept if x.step <= resumed]
        kept += mine
    return kept


def judge(records: Sequence[Any]) -> Verdict:
    """The invariant's verdict over every data record of a run."""
    lines: list[Line] = []
    for d in records:
        line, why = parse(d)
        if line is None:
            return Verdict(None, f"unknown: {why}")
        lines.append(line)
    if not lines:
        return Verdict(None, "unknown: no batch was recorded")
    sizes = {x.samples for x in lines}
    if len(sizes) > 1:
        return Verdict(None, f"unknown: the records name datasets of {sorted(sizes)} samples")
    size = sizes.pop()
    history = final_history(lines)
    seen = {x.epoch for x in history}
    finished = sorted(e for e in seen if any(x.kind == "end" and x.epoch == e for x in history)
                      or any(f > e for f in seen))
    if not finished:
        return Verdict(None, "unknown: no epoch finished in the run's final history")
    dup: dict[int, dict[int, int]] = {}
    miss: dict[int, tuple[int, ...]] = {}
    for e in finished:
        got = Counter(i for x in history if x.epoch == e and x.kind == "batch" for i in x.indices)
        out = {i for x in history if x.epoch == e for i in x.dropped}
        twice = {i: n - 1 for i, n in sorted(got.items()) if n > 1}
        gone = tuple(i for i in range(size) if i not in got and i not in out)
        if twice:
            dup[e] = twice
        if gone:
            miss[e] = gone
    unfinished = sorted(seen - set(finished))
    tail = f"; epoch {unfinished[0]} unfinished, not judged" if unfinished else ""
    n = len(finished)
    if not dup and not miss:
        return Verdict(True, f"{n} finished epoch(s) of {size} samples, each sample once in the "
                             f"final history ({len(history)} record(s) kept of {len(lines)}){tail}",
                       tuple(finished))
    parts = []
    for e in finished:
        if e in dup:
            extra = sum(dup[e].values())
            parts.append(f"epoch {e}: {len(dup[e])} sample(s) trained more than once ({extra} extra): "
                         f"{_show(list(dup[e]))}")
        if e in miss:
            parts.append(f"epoch {e}: {len(miss[e])} sample(s) never trained: {_show(list(miss[e]))}")
    return Verdict(False, "; ".join(parts) + tail, tuple(finished), dup, miss)


def _show(xs: list[int]) -> str:
    head = ", ".join(map(str, xs[:SHOWN]))
    return head + (f", ... ({len(xs) - SHOWN} more)" if len(xs) > SHOWN else "")

"""Steps lost to a fault, judged from the runtime's records only, never from a script's output.

The records, from the workers' fault log (``ELASTICTK_FAULT_LOG``):

- the fault's own line: the step the failed process had reached and where that step came from
  (``checkpoint``/``loop``: the script's own step number, from ``elastictk.faults.fault_point``
  or ``run_elastic``; ``auto``: the optimizer steps this process counted, on from the step its
  ``State.restore()`` brought back, or from 0 without one);
- each process's ``progress`` line at its first step (the step and its source);
- ``restored`` lines, written by ``State.restore()``: the step the state came back at (null:
  nothing to restore, the state's initial values).

A script-numbered step says where the job was: the failed process was at step ``k``, the next
process of that rank first reported step ``r``, so ``k - r`` steps are run again. An optimizer
count is in the job's numbering only where the process's start is known: 0 in the first
attempt, its ``restored`` step after that (``elastictk.faults.auto`` counts on from it). Without a record
of where the next process resumed (a script that reloads a ``torch.save`` checkpoint of its
own, or never reloads at all) the loss is unknown, and :func:`lost_steps` says why instead of
guessing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

NUMBERED = ("checkpoint", "loop")


@dataclass(frozen=True)
class Lost:
    """``steps`` run again because of one fault, or None with ``why`` it cannot be known."""

    steps: Optional[int]
    why: str = ""


def _int(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _rank_of(target: str) -> Optional[int]:
    kind, _, idx = target.partition(":")
    return int(idx) if kind == "rank" and idx.isdigit() else None


def _next_attempt(lines: Sequence[dict[str, Any]], rank: int, after: int) -> Optional[int]:
    later = [a for d in lines if _int(d.get("rank")) == rank
             for a in (_int(d.get("attempt")),) if a is not None and a > after]
    return min(later, default=None)


def lost_steps(fault: dict[str, Any], progress: Sequence[dict[str, Any]],
               restored: Sequence[dict[str, Any]]) -> Lost:
    """Steps lost to the step fault whose fault-log line is ``fault`` (see the module's
    docstring); ``progress`` and ``restored`` are every such line of the run."""
    rank, attempt, step = _int(fault.get("rank")), _int(fault.get("attempt")), _int(fault.get("step"))
    source = fault.get("source")
    if rank is None or attempt is None or step is None:
        return Lost(None, "the fault's record names no rank, attempt or step")
    nxt = _next_attempt([*progress, *restored], rank, attempt)
    if nxt is None:
        return Lost(None, f"rank {rank} reported no step after the fault")
    if source in NUMBERED:
        first = next((d for d in progress if d.get("progress") == "first" and _int(d.get("rank")) == rank
                      and _int(d.get("attempt")) == nxt and d.get("source") in NUMBERED
                      and _int(d.get("step")) is not None), None)
        if first is None:
            return Lost(None, f"rank {rank} reported no numbered step in attempt {nxt}")
        return Lost(max(0, step - int(first["step"])))
    if source != "auto":
        return Lost(None, f"the fault's step came from {source!r}")
    # the count went on from the failed process's restored step (auto.py): the job's own number
    mine = next((d for d in restored if _int(d.get("pid")) == _int(fault.get("pid"))), None)
    if mine is None and attempt != 0:  # the first attempt starts the job, at 0
        return Lost(None, f"only optimizer steps were counted, and the failed process (attempt "
                          f"{attempt}) recorded no State.restore() to count them from")
    back = next((d for d in restored if _int(d.get("rank")) == rank and _int(d.get("attempt")) == nxt), None)
    if back is None:
        return Lost(None, f"only optimizer steps were counted and rank {rank} recorded no "
                          f"State.restore() in attempt {nxt}: a script that starts again from 0 and "
                          "one that reloads its own torch.save checkpoint look the same, so where it "
                          "resumed is not known; keep the state in elastictk.State, or report steps "
                          "with elastictk.faults.fault_point(step)")
    return Lost(max(0, step - (_int(back.get("restored")) or 0)))

"""Time faults sent from outside: a signal to the target's workers when the fault is due, only to
PIDs the agent reported in its event log and only while they are still descendants of the
launcher the runner started, so nothing outside the job is ever touched.

Apart from the runner's loop (``runner.py``) that calls it when a fault is due, and shared with
the nodes' runner (``multinode.py``): which process a fault hits, and when a fault that found
no target has waited long enough to count as not fired.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Optional

from ..lifetime import procfs
from .record import Injection, RunRecord

OUTSIDE_SIGNALS = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigsegv": signal.SIGSEGV,
                   "hang": signal.SIGSTOP}


def _current_workers(rec: RunRecord) -> dict[int, int]:
    """Global rank → PID of the attempt running now, from the last ``workers_started``."""
    pids: dict[int, int] = {}
    for e in rec.events:  # local rank == global rank on a single node
        if e.kind == "workers_started":
            pids = {int(k): int(v) for k, v in (e.fields.get("pids") or {}).items()}
        elif e.kind == "inplace_recovery":  # in place: the replacements of the failed ranks
            pids.update({int(k): int(v) for k, v in (e.fields.get("replaced") or {}).items()})
    return pids


#: A time fault whose target is not running when it is due (its workers are being restarted
#: after an earlier fault, its round is re-forming) fires as soon as the target runs again,
#: within this many seconds of the planned time; only then has it not fired. Under load a
#: restart takes seconds, and a fault planned into that gap says nothing about the job.
LATE_GRACE_S = 15.0


def late(rec: RunRecord, fault: Any, now: float) -> bool:
    """Whether a due time fault that found no target is past its grace."""
    return now - (rec.clock if rec.clock is not None else rec.started) - float(fault.at_s or 0) > LATE_GRACE_S


def _inject_outside(index: int, fault: Any, rec: RunRecord, launcher: int) -> Optional[Injection]:
    """Send the signal of a time fault to its target, if the target is ours and alive."""
    workers = _current_workers(rec)
    rank = fault.target.index if fault.target.kind == "rank" else None
    targets = list(workers.values()) if fault.target.kind == "node" else (
        [workers[rank]] if rank in workers else [])
    ours = _descendants(launcher)
    sig = OUTSIDE_SIGNALS.get(fault.kind)
    hit = [pid for pid in targets if pid in ours]
    if sig is None or not hit:
        at = time.monotonic() - (rec.clock if rec.clock is not None else rec.started)
        rec.unfired[index] = (f"{fault.target} had no running worker at {at:.1f}s (ranks then: "
                              f"{', '.join(map(str, sorted(workers))) or 'none'})")
        return None
    now = time.monotonic()
    for pid in hit:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return Injection(index, fault.spec, str(fault.target), now, hit[0], how="outside")


def _descendants(pid: int) -> set[int]:
    return procfs.descendants(pid)

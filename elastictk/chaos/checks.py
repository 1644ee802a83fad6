"""The chaos report's invariants, one builder each: every fault fired and was detected, hangs
caught with their rank named, stragglers named and no other, nothing leaked, progress lost within
the checkpoint or snapshot interval, the result equal to a fault-free run's.

Apart from the rows they judge (``rows.py``) and from the report that picks which apply and
prints them (``report.py``): a reader looking for why a verdict said ``[BROKEN]`` or
``[UNKNOWN]`` finds each invariant's rule, and its failing side, here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .rows import RUNNING_EVENTS, FaultRow, _first, launcher_flag
from .record import RunRecord

FIRED = "every planned fault fired"


@dataclass(frozen=True)
class Check:
    """One invariant. ``unknown``: not judged, the records cannot tell (a loss no record shows,
    data no loader recorded); it does not pass (``ok`` is False) and reads ``[UNKNOWN]``, not
    ``[BROKEN]``: the job may be right, the run proved nothing about it."""

    name: str
    ok: bool
    detail: str
    unknown: bool = False


def label(c: Check) -> str:
    """``ok``, ``UNKNOWN`` (not judged, does not pass) or ``BROKEN``."""
    return "ok" if c.ok else "UNKNOWN" if c.unknown else "BROKEN"


def snapshot_bound(kind: str, tiers: tuple[str, ...], every: int, overlap: bool = False) -> Optional[int]:
    """The most steps a fault may cost a job committing every step with these snapshot tiers:
    one (the step in flight) while the local tier survives it, ``every`` when only the disk
    tier does (a killed agent takes its node's memory), None when no tier survives it.
    ``overlap`` (pipelined commits): one more, for a fault while the last commit is copied."""
    extra = 1 if overlap else 0
    if "local" in tiers and kind != "kill-agent":
        return 1 + extra
    return every + extra if "disk" in tiers else None


def _snapshot_check(rows: list[FaultRow], tiers: tuple[str, ...], every: int, overlap: bool = False) -> Check:
    """Steps lost per fault <= the interval of the snapshot tier that survives the fault."""
    unknown = _unknown_losses(rows)
    over: list[str] = []
    for r in rows:
        if r.lost_steps is None:
            continue
        bound = snapshot_bound(r.kind, tiers, every, overlap)
        if bound is None:
            over.append(f"#{r.index} {r.kind} lost {r.lost_steps} step(s): no tier of --snapshot "
                        f"{','.join(tiers)} survives it (the local tier dies with its agent; add disk)")
        elif r.lost_steps > bound:
            over.append(f"#{r.index} {r.kind} lost {r.lost_steps} step(s), more than {bound}: "
                        "was the snapshot restored (state.restore())?")
    worst = max((r.lost_steps or 0 for r in rows), default=0)
    extra = 1 if overlap else 0
    bounds = f"{1 + extra} step(s) (local memory{', pipelined' if overlap else ''})" if "local" in tiers else ""
    if "disk" in tiers:
        bounds += (", " if bounds else "") + f"{every + extra} steps (disk{', a lost agent' if bounds else ''})"
    return Check("steps lost per fault <= the snapshot interval", not (over or unknown),
                 "; ".join(unknown + over) or f"at most {worst} step(s) lost, interval {bounds}",
                 unknown=bool(unknown) and not over)


def _unknown_losses(rows: list[FaultRow]) -> list[str]:
    """Faults that cost a restart and whose lost steps the records cannot tell: a check on
    lost steps does not pass on them (it has no evidence), it names each and why."""
    return [f"#{r.index} {r.kind} lost an unknown number of step(s): {r.lost_why or 'not recorded'}"
            for r in rows if r.fired and r.needs_restart and r.lost_steps is None and r.running_after is not None]


def _fired(rows: list[FaultRow], allow: bool, beyond: Optional[set[int]] = None,
           max_restarts: Optional[int] = None) -> Check:
    """Every planned fault fired. One planned past the restart budget cannot (the job gives up
    before its attempt): it fails the check all the same, naming the budget, since a plan that
    cannot run whole proves less than it says (``--allow-unfired`` lets it pass)."""
    beyond = beyond or set()
    missed = [r for r in rows if not r.fired]
    if not missed:
        return Check(FIRED, True, f"{len(rows)} of {len(rows)} fired")

    def why(r: FaultRow) -> str:
        if r.index not in beyond or max_restarts is None:
            return str(r.why)
        return (f"planned in attempt {r.attempt}, past --max-restarts {max_restarts}: the job gives up "
                f"after {max_restarts + 1} failure(s), so it can never fire; plan at most "
                f"{max_restarts + 1} fault(s) that need a restart, or raise --max-restarts")
    said = "; ".join(f"#{r.index} {r.kind} on {r.target} at {r.planned}: {why(r)}" for r in missed)
    return Check(FIRED, allow, f"{len(missed)} of {len(rows)} did not fire"
                 + (" (allowed by --allow-unfired)" if allow else "") + f": {said}")


def _detected(rows: list[FaultRow]) -> Check:
    missed = [f"#{r.index} {r.kind}" for r in rows if r.fired and r.needs_restart and r.detected_after is None]
    return Check("every fault that needed a restart was detected", not missed,
                 ", ".join(missed) + " never seen by the agent" if missed else "all seen")


HANG_CAUGHT = ("timer_expired", "hang_detected")


def _names(event: Any, rank: int) -> bool:
    """Whether a watchdog's event blames ``rank``: a timer names the rank whose collective it
    timed; the progress watchdog names its culprits apart from the ranks blocked on them."""
    if event.kind == "timer_expired":
        return event.fields.get("rank") == rank
    return rank in (event.fields.get("culprits") or [event.fields.get("rank")])


def _hangs_caught(rows: list[FaultRow], rec: RunRecord, several_nodes: bool) -> Check:
    """Every fired ``hang`` was caught by a watchdog (a collective timer or the progress
    watchdog) that named the frozen rank as the culprit. On several nodes each agent judges
    its own ranks, so another node may blame its waiting rank first; there a catch counts."""
    bad, times = [], []
    for r in rows:
        if not (r.fired and r.kind == "hang" and r.injected_at is not None):
            continue
        rank = int(r.target.split(":")[1])
        at = rec.started + r.injected_at
        caught = [e for e in rec.events if e.kind in HANG_CAUGHT and e.mono >= at]
        if not caught:
            bad.append(f"#{r.index} hang of {r.target} never caught by a watchdog")
            continue
        # how long the catch took beside the deadline it was judged against (the learned one
        # under --hang-detection learned, else the timer's or --progress-timeout)
        deadline = caught[0].fields.get("timeout_s")
        times.append(f"#{r.index} in {caught[0].mono - at:.1f}s" + (
            f" ({caught[0].fields.get('trigger')} deadline {float(deadline):.1f}s)"
            if isinstance(deadline, (int, float)) and deadline > 0 else ""))
        # Every catch of this incident counts, up to the workers running again: a frozen rank
        # blocks its peers inside the same collective, so their timers expire together and the
        # waiting rank's may be logged first.
        back = _first(rec, RUNNING_EVENTS, caught[0].mono)
        incident = [e for e in caught if back is None or e.mono <= back]
        if not several_nodes and not any(_names(e, rank) for e in incident):
            bad.append(f"#{r.index} hang of {r.target}: the watchdog blamed "
                       f"{caught[0].fields.get('culprits', caught[0].fields.get('rank'))}")
    return Check("every hang caught, its rank named", not bad,
                 "; ".join(bad) or "all caught: " + ", ".join(times))


def straggler_settings(argv: list[str]) -> Optional[tuple[float, int]]:
    """``(interval, windows)`` of a run launched with ``--straggler-action report``; None when
    the run did not look for stragglers (the launcher's defaults otherwise: 5 s, 3)."""
    def value(flag: str) -> Optional[str]:
        return launcher_flag(argv, flag)
    if value("--straggler-action") != "report":
        return None
    try:
        return float(value("--straggler-interval") or 5), int(value("--straggler-windows") or 3)
    except ValueError:
        return None


def _stragglers(rows: list[FaultRow], rec: RunRecord) -> list[Check]:
    """With ``--straggler-action report``: every fired ``slow:<s>`` of a rank is named (a
    ``straggler`` event for that rank) within ``s + (windows + 2) x interval`` of the fault,
    and no rank that no ``slow`` fault hit is ever named (a fault-free run names none). A fault
    whose bound reaches past the job's end is not judged (its window never closed), and says so."""
    settings = straggler_settings(rec.argv)
    if settings is None:
        return []
    interval, windows = settings
    named = [e for e in rec.events if e.kind == "straggler"]
    slowed: set[int] = set()
    bad: list[str] = []
    unjudged: list[str] = []
    for r in rows:
        if not (r.fired and r.kind.startswith("slow") and r.target.startswith("rank:")
                and r.injected_at is not None):
            continue
        rank = int(r.target.split(":")[1])
        slowed.add(rank)
        at = rec.started + r.injected_at
        bound = float(r.kind.partition(":")[2] or 0) + (windows + 2) * interval
        hit = [e for e in named if e.fields.get("rank") == rank and at <= e.mono <= at + bound]
        if hit:
            continue
        if at + bound > rec.ended:  # the job ended inside the bound: its last window never closed
            unjudged.append(f"#{r.index}")
        else:
            bad.append(f"#{r.index} {r.kind} of {r.target} not named a straggler within {bound:g}s")
    wrong = sorted({e.fields.get("rank") for e in named} - slowed, key=str)
    if wrong:
        bad.append(f"rank(s) {', '.join(map(str, wrong))} named a straggler but no slow fault hit them")
    late = f" ({', '.join(unjudged)} not judged: the job ended within its bound)" if unjudged else ""
    return [Check("every slow rank named a straggler, no other", not bad,
                  ("; ".join(bad) or f"{len(slowed)} slow rank(s) named, no other") + late)]


def _common(rec: RunRecord, rows: list[FaultRow], finished: bool, ckpt_every: Optional[int],
            expect_checksum: Optional[str]) -> list[Check]:
    out: list[Check] = []
    out.append(Check("no process of the job outlives the run", not rec.leaked_processes,
                     "; ".join(rec.leaked_processes) or f"{len(rec.pids)} process(es) checked"))
    out.append(Check("no leaked shared memory or listening port", not rec.leaked_shm and not rec.leaked_ports,
                     ", ".join(rec.leaked_shm + rec.leaked_ports) or "/dev/shm and listening ports as before"))
    if ckpt_every is not None:
        worst = max((r.lost_steps or 0 for r in rows), default=0)
        unknown = _unknown_losses(rows)
        over = [f"#{r.index} {r.kind} lost {r.lost_steps} step(s)" for r in rows
                if r.lost_steps is not None and r.lost_steps > ckpt_every]
        bad = unknown + over
        out.append(Check("progress lost per fault <= checkpoint interval", not bad,
                         ("; ".join(bad) + f" (interval {ckpt_every})") if bad else
                         f"at most {worst} step(s) lost, interval {ckpt_every}",
                         unknown=bool(unknown) and not over))
    if expect_checksum is not None and finished:
        out.append(Check("result equals the fault-free run's", rec.checksum == expect_checksum,
                         f"checksum {rec.checksum} vs fault-free {expect_checksum}"))
    return out

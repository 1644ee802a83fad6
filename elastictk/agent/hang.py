"""A hang as the progress watchdog declares it: the ranks, the culprits, and the report.

Apart from the watchdog (``progress.py``, which decides *when* a node's ranks are hung)
because this is *what* a hang is, read by more than the watchdog: the agent's failure path
names a worker's failure after it (``failure_cause.py``), in-place recovery declares one of
its own when the group's collective timed out on a stopped rank (:func:`declare_frozen`), and
the event log carries its fields. :func:`choose_culprits` is the pure choice of whom to blame
(stopped ranks, else the fewest steps, else the oldest last step, else all stalled ranks);
:func:`write_report` writes every rank's stacks to ``progress_hang.txt`` (or
``progress_stall.txt``) in the attempt's log directory.
"""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from .rankstacks import proc_state, pyspy_dump, where_pyspy

log = logging.getLogger("elastictk.agent")

REPORT_NAME = "progress_hang.txt"
STALL_REPORT = "progress_stall.txt"


@dataclass(frozen=True)
class RankState:
    """One local rank when the hang was declared."""

    local_rank: int
    rank: int
    pid: int
    steps: int  # steps since the group's clocks started (arm or last replacement)
    idle_s: float  # seconds since its last step (or its start, before its first)
    state: str  # /proc state: R, S, D, T (stopped) ...
    where: Optional[str]  # innermost user frame of its stack, "train.py:57 (main)"
    stacks: str
    stacks_from: str  # "faulthandler", "py-spy", or why there are none

    @property
    def stopped(self) -> bool:
        return self.state in ("T", "t")


@dataclass(frozen=True)
class Hang:
    """What the progress watchdog found; culprits are killed, blocked ranks are left to the
    agent's recovery."""

    kind: str  # "progress", "learned" (past the learned deadline), "startup", "stopped_peer"
    # (found when a peer failed) or
    # "group_timeout" (in place: the group's collective timed out on a stopped rank)
    timeout_s: float
    culprits: tuple[RankState, ...]
    blocked: tuple[RankState, ...]
    reason: str  # why these are the culprits
    host: str
    report_path: Optional[str]
    declared_at: float = 0.0  # time.monotonic() when declared: where a recovery's detect begins

    def headline(self) -> str:
        c = self.culprits[0]
        what = {"progress": f"made no progress for {c.idle_s:.1f}s",
                "learned": f"made no progress for {c.idle_s:.1f}s (learned deadline {self.timeout_s:.1f}s)",
                "startup": f"completed no first step for {c.idle_s:.1f}s",
                "stopped_peer": "was stopped (state T) while a peer failed waiting on it",
                "group_timeout": "was stopped (state T) while its peers' collective timed out on it"}[self.kind]
        where = f" at {c.where}" if c.where else ""
        return f"rank {c.rank} {what}{where} (progress watchdog)"

    def describe(self) -> str:
        """The agent's one log line."""
        gap = "without progress" if self.kind == "learned" else "without a step"
        names = ", ".join(f"rank {c.rank} (pid {c.pid}, {c.idle_s:.1f}s {gap}"
                          f"{', stopped' if c.stopped else ''}{', at ' + c.where if c.where else ''})"
                          for c in self.culprits)
        blocked = ", ".join(str(b.rank) for b in self.blocked) or "none on this node"
        flag = {"progress": f"--progress-timeout {self.timeout_s:g}",
                "learned": f"learned deadline {self.timeout_s:.1f}s, --hang-detection learned",
                "startup": f"--startup-timeout {self.timeout_s:g}",
                "stopped_peer": "found when a peer failed",
                "group_timeout": "found when the group's collective timed out"}[self.kind]
        stacks = f"stacks in {self.report_path}" if self.report_path else \
            f"stacks: {self.culprits[0].stacks_from}"
        return (f"hang on {self.host}: {names} [{self.reason}; {flag}]; "
                f"blocked waiting on it: ranks {blocked}; killing the culprit; {stacks}")

    def fields(self) -> dict[str, object]:
        """The ``hang_detected`` event's fields."""
        c = self.culprits[0]
        return {"trigger": self.kind, "rank": c.rank, "local_rank": c.local_rank, "pid": c.pid,
                "host": self.host, "idle_s": round(c.idle_s, 2), "where": c.where,
                "culprits": [x.rank for x in self.culprits], "blocked": [x.rank for x in self.blocked],
                "reason": self.reason, "timeout_s": self.timeout_s, "report": self.report_path,
                "stacks_from": c.stacks_from}


def choose_culprits(kind: str, due: list[int], states: Mapping[int, str], steps: Mapping[int, int],
              idle: Mapping[int, float], stepped: Mapping[int, bool]) -> tuple[list[int], str]:
    """Which ranks stopped progressing first, and why we think so."""
    stopped = sorted(lr for lr, s in states.items() if s in ("T", "t"))
    if stopped:
        return stopped, "stopped by a signal (state T)"
    if kind == "startup":
        return sorted(lr for lr in due if not stepped[lr]), "never completed a first step"
    low = min(steps.values())
    if len(set(steps.values())) > 1:
        return sorted(lr for lr, n in steps.items() if n == low), f"fewest steps ({low})"
    oldest, newest = max(idle.values()), min(idle.values())
    if oldest - newest > 1.0:
        return sorted(lr for lr, s in idle.items() if oldest - s <= 1.0), "oldest last step"
    return sorted(due), "no rank stands out: all stalled together"


def declare_frozen(pids: Mapping[int, int], ranks: Mapping[int, int], frozen: list[int],
                   report_dir: object) -> Hang:
    """In place, the group's collective timed out and ``frozen`` (local ranks, state T) are why:
    the hang restart-all's watchdogs would declare, with the stopped ranks' stacks dumped
    (py-spy reads a stopped process without resuming it) and written to the hang report
    before the caller kills them. The other ranks are listed as blocked, not dumped: they
    have left the failed collective and wait for the next generation, so their stacks would
    show the recovery, not the hang."""
    now = time.monotonic()
    infos: dict[int, RankState] = {}
    for lr, pid in sorted(pids.items()):
        state = proc_state(pid)
        if lr in frozen:
            text, note = pyspy_dump(pid, stopped=True)
            dump = (text, "py-spy" if text else note, where_pyspy(text) if text else None)
        else:
            dump = ("", "not dumped: waiting for the next generation", None)
        infos[lr] = RankState(lr, ranks.get(lr, lr), pid, 0, 0.0, state, dump[2], dump[0], dump[1])
    path = write_report(Path(str(report_dir)) if report_dir is not None else None, "group_timeout",
                         0.0, infos, frozen)
    return Hang("group_timeout", 0.0, tuple(infos[lr] for lr in frozen if lr in infos),
                tuple(infos[lr] for lr in sorted(infos) if lr not in frozen),
                "stopped by a signal (state T)", socket.gethostname(), path, declared_at=now)


def write_report(report_dir: Optional[Path], kind: str, timeout: float,
                  infos: Mapping[int, RankState], culprits: list[int],
                  name: str = REPORT_NAME) -> Optional[str]:
    """The hang (or stall) report: each rank's role, steps, idle time and stacks; its path, or
    None without a report directory or where it cannot be written (one warning)."""
    if report_dir is None:
        return None
    head = {"stopped_peer": "a stopped rank found when a peer failed",
            "group_timeout": "a stopped rank found when the group's collective timed out",
            "learned": f"no progress past the learned deadline {timeout:.1f}s",
            "stalled": f"all ranks stalled together past the learned deadline {timeout:.1f}s (not killed)",
            }.get(kind, f"{kind} timeout {timeout:g}s")
    lines = [f"progress watchdog: {head} on {socket.gethostname()}", ""]
    for lr in sorted(infos):
        i = infos[lr]
        role = "CULPRIT" if lr in culprits else "blocked"
        lines += [f"== rank {i.rank} (local {lr}, pid {i.pid}, state {i.state}): {role}, "
                  f"{i.steps} steps, {i.idle_s:.1f}s without a step; stacks from {i.stacks_from}",
                  i.stacks.rstrip() or "(no stacks)", ""]
    return save_report(report_dir, name, lines, "hang report")


def save_report(report_dir: Path, name: str, lines: list[str], what: str) -> Optional[str]:
    """Write a report's lines to ``report_dir/name``; its path, or None (one warning naming
    ``what``) where it cannot be written."""
    try:
        report_dir.mkdir(parents=True, exist_ok=True)
        path = report_dir / name
        path.write_text("\n".join(lines))
        return str(path)
    except OSError as e:
        log.warning("cannot write the %s to %s: %s", what, report_dir, e)
        return None


__all__ = ["Hang", "RankState", "choose_culprits", "declare_frozen", "save_report", "write_report"]

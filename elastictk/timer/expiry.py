"""What the reaper hands the agent when a worker's timer expired: an :class:`Expiry`.

Plain data, so the agent can put it in its failure summary ("rank 3 stuck in all_reduce at
train.py:57 (main)" instead of "exit code -9"), count it in metrics and log it as JSON; and
rendered to ``timer_expired.txt``/``.json`` in the rank's log directory with the full stacks.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

REASON = "timer_expired"


@dataclass(frozen=True)
class Expiry:
    """One worker whose timer ran out, caught before it was killed.

    Times are monotonic seconds (``deadline``, ``detected_at``) plus ``wall_time`` for logs.
    ``where`` is the innermost user frame of the stuck thread (``train.py:57 (main)``), or None
    when no stacks could be taken (``stacks_note`` says why). ``held`` lists every timer the
    worker held, ``(scope, seconds past its deadline)``, most overdue first.
    """

    local_rank: int
    rank: int
    pid: int
    scope: str
    deadline: float
    detected_at: float
    wall_time: float
    where: Optional[str]
    stacks: str
    stacks_note: str = ""
    held: tuple[tuple[str, float], ...] = ()
    report_path: Optional[str] = None
    reason: str = REASON

    @property
    def late_s(self) -> float:
        """How long after the deadline the reaper saw it."""
        return max(0.0, self.detected_at - self.deadline)

    def headline(self) -> str:
        """``rank 3 stuck in all_reduce at train.py:57 (main)``."""
        at = f" at {self.where}" if self.where else ""
        return f"rank {self.rank} stuck in {self.scope}{at}"

    def describe(self) -> str:
        """The headline plus how late it was caught and where the full report is."""
        text = (f"{self.headline()}: timer expired (caught {self.late_s * 1e3:.0f} ms after its "
                f"deadline), pid {self.pid} killed")
        if not self.where and self.stacks_note:
            text += f"; {self.stacks_note}"
        if self.report_path:
            text += f"; stacks in {self.report_path}"
        return text

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["held"] = [list(h) for h in self.held]
        d["late_s"] = self.late_s
        d["headline"] = self.headline()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Expiry":
        fields = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        fields["held"] = tuple((str(s), float(x)) for s, x in fields.get("held", ()))
        return cls(**fields)

    def render(self) -> str:
        """The human-readable hang report."""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.wall_time))
        lines = [
            self.headline(),
            "",
            f"  worker     rank {self.rank}, local rank {self.local_rank}, pid {self.pid}",
            f"  timer      {self.scope!r} expired; caught {self.late_s * 1e3:.1f} ms after its "
            f"deadline, at {when}",
        ]
        if len(self.held) > 1:
            held = ", ".join(f"{s} ({_rel(x)})" for s, x in self.held)
            lines.append(f"  held       {held}")
        lines.append("  action     stacks dumped, then SIGKILL")
        lines += ["", "Stacks of all threads (faulthandler, most recent call first):", ""]
        lines.append(self.stacks.rstrip() if self.stacks.strip()
                     else f"  (none: {self.stacks_note})")
        return "\n".join(lines) + "\n"


def _rel(seconds_past: float) -> str:
    if seconds_past >= 0:
        return f"{seconds_past:.3f} s overdue"
    return f"{-seconds_past:.3f} s left"


def report_file(directory: Path) -> Path:
    """Where :func:`write_report` puts the human-readable report."""
    return directory / "timer_expired.txt"


def write_report(expiry: Expiry, directory: Path) -> None:
    """Write ``timer_expired.txt`` and ``timer_expired.json`` into ``directory``.

    Written to temporary names and renamed, so a reader never sees half a report.
    """
    directory.mkdir(parents=True, exist_ok=True)
    txt = report_file(directory)
    for path, text in ((txt, expiry.render()),
                       (directory / "timer_expired.json",
                        json.dumps(expiry.to_json(), indent=2) + "\n")):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)

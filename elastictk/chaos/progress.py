"""The live progress line of an elastictk-chaos run: elapsed time, step, faults fired and
restarts spent, on one updating line on a terminal, as a few plain lines in a log.

Apart from the command line (``cli.py``) that hands it to the runner: it reads only the run's
record as it fills (the step display is the one use of the script's "step N" lines, never a
verdict), and how often it speaks off a terminal is its own concern.
"""
from __future__ import annotations

import sys
import time

from ..faults import FaultPlan
from .flags import PROG
from .record import RunRecord
from .rows import restarts_of

#: Not on a terminal (a CI log), the progress line is printed when a fault fires or a restart
#: happens, and otherwise once per this many seconds while the step moves.
PROGRESS_EVERY_S = 10.0


class Progress:
    """One updating line on a terminal. Elsewhere (a CI log, a pipe) a plain line per fault
    fired or restart, one every :data:`PROGRESS_EVERY_S` seconds while steps advance, and the
    last state at the end: a log of a long run stays readable, never a line per step."""

    def __init__(self, plan: FaultPlan, max_restarts: int, stream=sys.stderr,  # type: ignore[no-untyped-def]
                 every: float = PROGRESS_EVERY_S, clock=time.monotonic) -> None:
        self.plan, self.max_restarts, self.stream = plan, max_restarts, stream
        self.tty = stream.isatty()
        self.every, self.clock = every, clock
        self.last = ""
        self.last_events: tuple[int, int] | None = None
        self.printed_at: float | None = None
        self.pending = ""  # the newest line not printed yet (off a terminal)

    def __call__(self, rec: RunRecord) -> None:
        now = self.clock()
        restarts = restarts_of(rec)
        step = max((s for _, s in rec.steps), default=0)
        fired = len({i.fault for i in rec.injections})
        line = (f"{PROG}: {now - rec.started:5.1f}s  step {step}  faults {fired}/"
                f"{len(self.plan)}  restarts {restarts}/{self.max_restarts}")
        key = line.split("s  ", 1)[1]
        if self.tty:
            self.stream.write("\r" + line.ljust(72))
            self.stream.flush()
        elif key != self.last:
            events = (fired, restarts)
            due = self.printed_at is None or now - self.printed_at >= self.every
            if events != self.last_events or due:
                print(line, file=self.stream, flush=True)
                self.printed_at, self.last_events, self.pending = now, events, ""
            else:
                self.pending = line
        self.last = key

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")
        elif self.pending:  # the last state, if it was held back
            print(self.pending, file=self.stream, flush=True)
            self.pending = ""

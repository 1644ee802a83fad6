"""``--health-check CMD``: a node that fails its own check stays out of the job (or leaves it).

A GPU with ECC errors, a full disk or a missing mount makes every worker on the node fail,
and each failure spends a restart of the whole job. The operator knows how to test for it:
a command. The agent runs it (through ``sh -c``, in a session of its own, so a check that
hangs is killed with everything it started) before it joins each rendezvous round, and again
every ``--health-interval`` seconds while it is kept out and while it is in a round
(:class:`HealthWatch`, one thread that sleeps the interval). A non-zero exit (or a check that
outlives its timeout) keeps the node out: one event and one log line carry the command's last
line of output. The node joins once the check passes; if it does not pass within the
rendezvous join timeout, the agent gives up with one line (a job of one node then ends, as
it would waiting for peers that never come).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..metrics.kinds import Emit, EventKind

log = logging.getLogger("elastictk.agent")

MAX_LINE = 500  # characters of the last output line kept for events and messages


@dataclass(frozen=True)
class HealthResult:
    """One run of the check: passed, how it ended, and its last line of output."""

    ok: bool
    exit: str  # "code 0", "code 3", "SIGKILL", "timed out after 10s", "cannot run: ..."
    line: str
    seconds: float


def check_settings(command: str | None, interval: float) -> None:
    """ValueError (one line) for a check that cannot be what was meant."""
    if command is not None and not command.strip():
        raise ValueError("--health-check is empty: give a command, e.g. --health-check 'nvidia-smi -L'")
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval <= 86400:
        raise ValueError(f"--health-interval {interval!r} must be seconds > 0 and at most 86400")


def run_check(command: str, timeout: float) -> HealthResult:
    """Run ``command`` once; its stdout and stderr together, the last non-empty line kept."""
    t0 = time.monotonic()
    try:
        p = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        return HealthResult(False, f"cannot run: {e.strerror or e}", "", time.monotonic() - t0)
    try:
        out, _ = p.communicate(timeout=timeout)
        how = f"code {p.returncode}" if p.returncode >= 0 else signal.Signals(-p.returncode).name
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the session: the shell and whatever it started
        except ProcessLookupError:
            pass
        out, _ = p.communicate()
        how = f"timed out after {timeout:g}s"
        p.returncode = p.returncode or -1
    lines = [ln.strip() for ln in out.decode(errors="replace").splitlines() if ln.strip()]
    line = lines[-1][:MAX_LINE] if lines else ""
    return HealthResult(p.returncode == 0 and how == "code 0", how, line, time.monotonic() - t0)


def check_timeout(interval: float) -> float:
    """How long one check may run: the interval, but never less than 10 s."""
    return max(10.0, float(interval))


class HealthWatch:
    """Runs the check every ``interval`` seconds on a thread while a round runs; the first
    failure is kept in :attr:`failed` and ``on_fail()`` wakes the agent (it then leaves)."""

    def __init__(self, command: str, interval: float, on_fail: Callable[[], None]) -> None:
        self.command, self.interval = command, float(interval)
        self.failed: HealthResult | None = None
        self._on_fail = on_fail
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastictk-health", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            res = run_check(self.command, check_timeout(self.interval))
            if not res.ok and not self._stop.is_set():
                self.failed = res
                self._on_fail()
                return

    def stop(self) -> None:
        """Stop checking; returns at once (a check in flight ends within its timeout)."""
        self._stop.set()


__all__ = ["HealthResult", "HealthWatch", "check_settings", "check_timeout", "run_check"]


def hold_until_healthy(command: str, interval: float, join_timeout: float, *, stop_workers: Callable[[], bool],
                       emit: Emit, backoff: Callable[[float], None], stopping: Callable[[], bool]) -> str | None:
    """The gate before a round: None once the check passes; while it fails this node stays out
    (an event and a log line each time; ``stop_workers`` stops the workers kept for the next
    round, True if there were some), re-checked every ``interval`` through ``backoff``. Returns
    why the agent gives up when the check has not passed within ``join_timeout``, or "" when
    ``stopping`` says a terminating signal came meanwhile."""
    deadline = time.monotonic() + join_timeout
    while True:
        res = run_check(command, check_timeout(interval))
        if res.ok:
            return None
        if stop_workers():
            emit(EventKind.WORKERS_STOPPED, reason="health_check_failed")
        emit(EventKind.HEALTH_CHECK_FAILED, command=command, exit=res.exit, line=res.line)
        log.warning("health check failed (%s): %s; this node stays out of the job, next check in %gs",
                    res.exit, res.line or "(no output)", interval)
        if time.monotonic() >= deadline:
            return (f"health check failed ({res.exit}: {res.line or 'no output'}): this node stayed out "
                    f"for the join timeout ({join_timeout:g}s) and gives up; fix the node or "
                    f"the check ({command!r})")
        backoff(min(interval, max(0.0, deadline - time.monotonic())))
        if stopping():
            return ""

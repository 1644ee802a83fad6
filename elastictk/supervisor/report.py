"""The failure report: which worker failed first, how, and why, built from worker results.

torchrun answers "what broke?" with a table keyed on error-file timestamps (one-second
resolution, absent for signals) and prints ``exitcode: -11``. This report orders failures by the
supervisor's own monotonic end times, names signals (``SIGSEGV (signal 11)``), shows the
traceback from the error file or, when there is none or it is garbage, the tail of the worker's
stderr log, and says plainly which of the two it used and why.

Everything here is a pure function of worker results and files on disk, except
``FailureReport.collect`` which reads the host name and the clock offset once at the edge.
"""
from __future__ import annotations

import re
import signal as _signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Protocol

from .errors import ErrorFileUnreadable, ErrorRecord, read_error_file
from .tail import MAX_TAIL_LINES, TAIL_LINES, pick_tail, read_tail

__all__ = [
    "FailureReport", "ProcessFailure", "WorkerExit", "WorkerOutcome",
    "describe_exit", "failure_of", "is_failure", "signal_label", "signal_number",
    "MAX_TAIL_LINES", "TAIL_LINES", "pick_tail", "read_tail",
]

SCHEMA = "elastictk.failure/1"


class WorkerOutcome(Protocol):
    """What the report needs from one worker's result (read-only, so frozen dataclasses fit;
    the worker group's ``WorkerResult`` does). Times are monotonic; ``exitcode`` is None while
    running and negative (Popen style) when a signal ended the process."""

    @property
    def local_rank(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def pid(self) -> int: ...
    @property
    def exitcode(self) -> Optional[int]: ...
    @property
    def signal(self) -> Optional[int]: ...
    @property
    def started_at(self) -> float: ...
    @property
    def ended_at(self) -> Optional[float]: ...
    @property
    def stderr_path(self) -> Optional[str]: ...
    @property
    def error_file(self) -> Optional[str]: ...


@dataclass(frozen=True)
class WorkerExit:
    """A plain ``WorkerOutcome``: for callers that hold results in another shape, and tests."""

    local_rank: int
    rank: int
    pid: int
    exitcode: Optional[int]
    signal: Optional[int] = None
    started_at: float = 0.0
    ended_at: Optional[float] = None
    stdout_path: Optional[str] = None
    stderr_path: Optional[str] = None
    error_file: Optional[str] = None
    stopped: bool = False  # the supervisor had already signalled it (optional on other results)


def signal_number(exitcode: Optional[int], signum: Optional[int]) -> Optional[int]:
    """The signal that ended a process, from either an explicit number or a negative code."""
    if signum:
        return signum
    if exitcode is not None and exitcode < 0:
        return -exitcode
    return None


def signal_label(signum: int) -> str:
    """``SIGSEGV (signal 11)``; an unknown number stays a number."""
    try:
        return f"{_signal.Signals(signum).name} (signal {signum})"
    except ValueError:
        return f"signal {signum}"


def describe_exit(exitcode: Optional[int], signum: Optional[int] = None) -> str:
    """How a process ended, in words a person reads without a signal table."""
    sig = signal_number(exitcode, signum)
    if sig is not None:
        return signal_label(sig)
    if exitcode is None:
        return "still running"
    if exitcode > 128 and exitcode - 128 in _signal.valid_signals():
        # A shell (or bash -c wrapper) reports a child killed by signal N as 128+N.
        return f"exit code {exitcode} (128+{exitcode - 128}: {signal_label(exitcode - 128)} via a shell?)"
    return f"exit code {exitcode}"


def is_failure(w: WorkerOutcome) -> bool:
    """A worker failed when it has ended with a signal or a non-zero exit code."""
    if w.ended_at is None and w.exitcode is None:
        return False
    return signal_number(w.exitcode, w.signal) is not None or (w.exitcode or 0) != 0


@dataclass(frozen=True)
class ProcessFailure:
    """One failed worker, as plain data (JSON round-trips through ``to_json``/``from_json``)."""

    rank: int
    local_rank: int
    pid: int
    hostname: str
    exitcode: Optional[int]
    signal: Optional[int]
    started_at: float  # monotonic, on ``hostname``
    ended_at: float  # monotonic, on ``hostname``
    ended_wall: Optional[float] = None  # seconds since the epoch, for people
    error_file: Optional[str] = None
    error: Optional[ErrorRecord] = None
    error_file_problem: Optional[str] = None  # why ``error`` is None although a path was set
    stderr_path: Optional[str] = None
    stderr_tail: tuple[str, ...] = ()
    stderr_problem: Optional[str] = None
    stopped_by_supervisor: bool = False
    hang: Optional[str] = None  # the watchdog's headline when its timer expired: why it was killed
    hang_detail: Optional[str] = None  # how late it was caught, where the stacks are

    @property
    def exit_description(self) -> str:
        return describe_exit(self.exitcode, self.signal)

    @property
    def duration_s(self) -> float:
        return max(0.0, self.ended_at - self.started_at)

    @property
    def error_code(self) -> int:
        """torch's convention for ``errorCode``: the exit code, negative for a signal."""
        sig = signal_number(self.exitcode, self.signal)
        return -sig if sig is not None else int(self.exitcode or 0)

    def cause(self, limit: int = 100) -> str:
        """A noun phrase for one-line messages: ``rank 1's SIGSEGV (signal 11)``."""
        if self.hang is not None:
            # a timer's headline gets its cause; the progress watchdog's names itself
            return self.hang if "(progress watchdog)" in self.hang else f"{self.hang} (watchdog timer expired)"
        if self.error is not None:
            what = self.error.message
        else:
            raised = exception_in(self.stderr_tail) if self.signal is None and (self.exitcode or 0) > 0 else None
            what = f"{raised} ({self.exit_description})" if raised else self.exit_description
        what = " ".join(what.split())
        if len(what) > limit:
            what = what[: limit - 3] + "..."
        return f"rank {self.rank}'s {what}"

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "local_rank": self.local_rank, "pid": self.pid,
            "hostname": self.hostname, "exitcode": self.exitcode, "signal": self.signal,
            "exit": self.exit_description, "started_at": self.started_at,
            "ended_at": self.ended_at, "ended_wall": self.ended_wall,
            "error_file": self.error_file,
            "error": self.error.to_json() if self.error is not None else None,
            "error_file_problem": self.error_file_problem, "stderr_path": self.stderr_path,
            "stderr_tail": list(self.stderr_tail), "stderr_problem": self.stderr_problem,
            "stopped_by_supervisor": self.stopped_by_supervisor,
            "hang": self.hang, "hang_detail": self.hang_detail,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ProcessFailure:
        try:
            err = d.get("error")
            error = None
            if err is not None:
                error = ErrorRecord(message=str(err["message"]), traceback=err.get("traceback"),
                                    timestamp=err.get("timestamp"), error_code=err.get("error_code"))
            return cls(
                rank=int(d["rank"]), local_rank=int(d["local_rank"]), pid=int(d["pid"]),
                hostname=str(d["hostname"]), exitcode=d.get("exitcode"), signal=d.get("signal"),
                started_at=float(d["started_at"]), ended_at=float(d["ended_at"]),
                ended_wall=d.get("ended_wall"), error_file=d.get("error_file"), error=error,
                error_file_problem=d.get("error_file_problem"), stderr_path=d.get("stderr_path"),
                stderr_tail=tuple(d.get("stderr_tail") or ()),
                stderr_problem=d.get("stderr_problem"),
                stopped_by_supervisor=bool(d.get("stopped_by_supervisor", False)),
                hang=d.get("hang"), hang_detail=d.get("hang_detail"),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not an elastictk failure record ({type(e).__name__}: {e})") from None


_EXC_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Warning)"
                       r"(?::\s.*)?$")


def exception_in(tail: Iterable[str]) -> Optional[str]:
    """The exception a Python worker died of, read from its stderr tail: the first unindented
    line after the last ``Traceback`` header (a traceback's frames are indented), else the last
    line shaped like ``SyntaxError: ...`` (a script the interpreter could not compile prints no
    header). Used only to name the cause for a person when the worker wrote no error file
    (no ``@elastictk.record``); None when the tail shows no exception."""
    lines = [line.rstrip("\n") for line in tail]
    header = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")),
                 default=None)
    if header is not None:
        for line in lines[header + 1:]:
            if line and not line[0].isspace():
                return line.strip()[:300] or None
    for line in reversed(lines):
        if _EXC_LINE.match(line.strip()) and not line[:1].isspace():
            return line.strip()[:300]
    return None


def failure_of(w: WorkerOutcome, *, hostname: str, wall_offset: Optional[float] = None,
               stopped: bool = False, tail_lines: int = TAIL_LINES,
               hang: Optional[tuple[str, str]] = None) -> ProcessFailure:
    """Build one ``ProcessFailure``: read the error file, and the stderr tail when it has none.

    ``wall_offset`` is ``time.time() - time.monotonic()`` on the worker's host (None: unknown).
    ``hang``: (headline, detail) when the watchdog killed this worker.
    """
    ended = w.ended_at if w.ended_at is not None else w.started_at
    error: Optional[ErrorRecord] = None
    problem: Optional[str] = None
    if w.error_file:
        try:
            error = read_error_file(w.error_file)
        except ErrorFileUnreadable as e:
            problem = str(e)
    tail: list[str] = []
    stderr_problem: Optional[str] = None
    if error is None or not error.traceback:
        if w.stderr_path:
            try:
                tail = read_tail(w.stderr_path, tail_lines)
            except OSError as e:
                stderr_problem = f"cannot read {w.stderr_path}: {e.strerror or e}"
        else:
            stderr_problem = "stderr was not captured to a file"
    return ProcessFailure(
        rank=w.rank, local_rank=w.local_rank, pid=w.pid, hostname=hostname,
        exitcode=w.exitcode, signal=signal_number(w.exitcode, w.signal),
        started_at=w.started_at, ended_at=ended,
        ended_wall=ended + wall_offset if wall_offset is not None else None,
        error_file=w.error_file or None, error=error, error_file_problem=problem,
        stderr_path=w.stderr_path or None, stderr_tail=tuple(tail),
        stderr_problem=stderr_problem, stopped_by_supervisor=stopped,
        hang=hang[0] if hang else None, hang_detail=hang[1] if hang else None,
    )


@dataclass(frozen=True)
class FailureReport:
    """All failed workers of one attempt, first observed failure first."""

    failures: tuple[ProcessFailure, ...]
    total_workers: int
    hostname: str
    title: str = "worker group failed"
    restart_count: Optional[int] = None
    notes: tuple[str, ...] = field(default=())

    @property
    def root_cause(self) -> Optional[ProcessFailure]:
        return self.failures[0] if self.failures else None

    @classmethod
    def build(cls, results: Iterable[WorkerOutcome], *, hostname: str,
              wall_offset: Optional[float] = None, stopped: Iterable[int] = (),
              title: str = "worker group failed", restart_count: Optional[int] = None,
              tail_lines: int = TAIL_LINES,
              hangs: Optional[Mapping[int, tuple[str, str]]] = None) -> FailureReport:
        """Pure over its inputs and the files they name. ``stopped``: global ranks the supervisor
        itself terminated after the first failure (also read from a result's ``stopped`` flag),
        reported as such and never as the root cause unless nothing else failed. ``hangs``:
        PID → (headline, detail) of workers the watchdog killed, so the report says where a
        rank was stuck rather than only that it got SIGKILL."""
        hangs = hangs or {}
        results = list(results)
        stopped_set = set(stopped)
        failed = [w for w in results if is_failure(w)]
        failures = [failure_of(w, hostname=hostname, wall_offset=wall_offset,
                               stopped=w.rank in stopped_set or bool(getattr(w, "stopped", False)),
                               tail_lines=tail_lines, hang=hangs.get(w.pid))
                    for w in failed]
        failures.sort(key=lambda f: (f.stopped_by_supervisor, f.ended_at, f.rank))
        return cls(failures=tuple(failures), total_workers=len(results), hostname=hostname,
                   title=title, restart_count=restart_count)

    @classmethod
    def collect(cls, results: Iterable[WorkerOutcome], **kwargs: Any) -> FailureReport:
        """``build`` with this host's name and clock offset (the one impure entry point)."""
        kwargs.setdefault("hostname", socket.gethostname())
        kwargs.setdefault("wall_offset", time.time() - time.monotonic())
        return cls.build(results, **kwargs)

    def headline(self) -> str:
        """One line: ``worker group failed: 2 of 4 workers; first: rank 1's SIGSEGV (signal 11)``."""
        root = self.root_cause
        if root is None:
            return f"{self.title}: no worker failed"
        return (f"{self.title}: {len(self.failures)} of {self.total_workers} workers; "
                f"first: {root.cause()}")

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "title": self.title, "hostname": self.hostname,
            "total_workers": self.total_workers, "restart_count": self.restart_count,
            "notes": list(self.notes), "failures": [f.to_json() for f in self.failures],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FailureReport:
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise ValueError(f"not an elastictk failure report (expected schema {SCHEMA!r})")
        return cls(
            failures=tuple(ProcessFailure.from_json(f) for f in d.get("failures", [])),
            total_workers=int(d.get("total_workers", 0)), hostname=str(d.get("hostname", "")),
            title=str(d.get("title", "worker group failed")),
            restart_count=d.get("restart_count"), notes=tuple(d.get("notes") or ()),
        )

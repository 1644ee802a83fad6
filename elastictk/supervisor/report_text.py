"""How a failure report reads: the root cause in full (traceback, or the stderr tail and why),
the other failures one line each, in the order the supervisor observed them; and the exception
a launcher raises with that text.

Apart from ``report.py`` so the data (built, serialized, sent upward as an error file) and its
wording change separately; this module reads the data, never the other way round.
"""
from __future__ import annotations

import time
from datetime import datetime
from typing import Any, Iterable

from .report import FailureReport, ProcessFailure, signal_number


def _when(f: ProcessFailure) -> str:
    stamp = ""
    if f.ended_wall is not None:
        stamp = datetime.fromtimestamp(f.ended_wall).astimezone().isoformat(sep=" ", timespec="seconds")
        stamp = f" at {stamp}"
    return f"{stamp}, {f.duration_s:.1f}s after start"


def _error_file_line(f: ProcessFailure) -> str:
    if not f.error_file:
        return "not set for this worker"
    if f.error is not None:
        return f.error_file
    if f.error_file_problem:
        return f"{f.error_file_problem}; showing stderr instead"
    if signal_number(f.exitcode, f.signal) is not None:
        return f"none written to {f.error_file} (killed by a signal before Python could record)"
    return (f"none written to {f.error_file} (decorate the entry point with @elastictk.record "
            "to get its traceback here)")


def _block(lines: Iterable[str], prefix: str = "    ") -> list[str]:
    return [f"{prefix}{line}".rstrip() for line in lines]


def _describe(f: ProcessFailure, root: bool) -> list[str]:
    out = [
        f"  rank       : {f.rank} (local_rank {f.local_rank}), pid {f.pid}, host {f.hostname}",
        f"  exited     : {f.exit_description}{_when(f)}",
        f"  error file : {_error_file_line(f)}",
    ]
    if f.hang is not None:
        out.insert(2, f"  stuck      : {f.hang_detail or f.hang}")
    if f.error is not None:
        out.append(f"  exception  : {f.error.message}")
        if root and f.error.traceback:
            out.append("  traceback  :")
            out += _block(f.error.traceback.rstrip("\n").splitlines())
    if root and (f.error is None or not f.error.traceback):
        if f.stderr_tail:
            out.append(f"  stderr     : last {len(f.stderr_tail)} lines of {f.stderr_path}")
            out += _block(f.stderr_tail, "    | ")
        elif f.stderr_problem:
            out.append(f"  stderr     : {f.stderr_problem}")
        else:
            out.append(f"  stderr     : {f.stderr_path} is empty")
    return out


def render_text(report: FailureReport) -> str:
    """A readable multi-line block: the root cause in full, the others one line each."""
    lines = [f"=== {report.headline()} ==="]
    if report.restart_count is not None:
        lines.append(f"attempt with TORCHELASTIC_RESTART_COUNT={report.restart_count}")
    root = report.root_cause
    if root is not None:
        lines.append("Root cause (first observed failure):")
        lines += _describe(root, root=True)
        if len(report.failures) > 1:
            lines.append("Other failures, in the order observed:")
            for f in report.failures[1:]:
                later = f.ended_at - root.ended_at
                what = f.error.message if f.error is not None else f.hang or f.exit_description
                tag = ", stopped by the supervisor" if f.stopped_by_supervisor else ""
                lines.append(f"  rank {f.rank} (local_rank {f.local_rank}, pid {f.pid}): "
                             f"{what}, {later:+.2f}s{tag}")
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


def render_report(report: FailureReport) -> str:
    """The same as :func:`render_text` (its name before the split)."""
    return render_text(report)


class WorkerGroupFailed(RuntimeError):
    """Raised by a launcher whose workers failed; carries the report.

    Under ``@elastictk.record`` its ``error_file_payload`` sends the root cause's own error file
    upward (with ``errorCode`` set, as torch's ``ChildFailedError`` does) so a scheduler above a
    nested launcher sees the worker's traceback, not the launcher's.
    """

    def __init__(self, report: FailureReport) -> None:
        self.report = report
        super().__init__(render_text(report))

    def error_file_payload(self) -> dict[str, Any]:
        root = self.report.root_cause
        if root is None:
            raise ValueError("no failure to report")
        if root.error is not None and isinstance(root.error.raw.get("message"), dict):
            message = dict(root.error.raw["message"])
            message["errorCode"] = root.error_code
            return {**root.error.raw, "message": message}
        stamp = int(root.ended_wall if root.ended_wall is not None else time.time())
        detail = "\n".join(root.stderr_tail) or root.exit_description
        return {"message": {
            "message": f"{root.cause()} (pid {root.pid}, host {root.hostname})",
            "extraInfo": {"py_callstack": detail, "timestamp": str(stamp)},
            "errorCode": root.error_code,
        }}

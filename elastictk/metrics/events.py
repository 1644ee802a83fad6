"""The event log: every transition of a job as one JSON line, for people and for tools.

:class:`EventLog` is an ``on_event(kind, **fields)`` sink. Each event becomes one line::

    {"seq": 3, "kind": "worker_failed", "time": "2024-05-01T12:00:00.123456Z",
     "wall": 1714564800.123456, "mono": 5123.25, "pid": 4242, "run_id": "job1",
     "node_id": "host-4242-ab12cd", "fields": {"rank": 1, "exit": "SIGKILL", ...}}

``mono`` (``CLOCK_MONOTONIC``) orders and subtracts events of one host exactly; ``wall`` is for
people and for lining up hosts. Fields sit under ``"fields"`` so no field can shadow the
envelope. The file is created mode 0600 (its directory, if made here, 0700) and opened
``O_APPEND|O_NOFOLLOW`` in a directory of this user's that others cannot write (or a sticky one
such as ``/tmp``; see ``elastictk/_paths.py``), and each line is one ``write()``: lines are
flushed as they happen, never overwritten by a later attempt or run, and two agents appending
to one file interleave whole lines.

The default place is ``<log_dir>/<run_id>/events.jsonl``, beside the attempt logs. That
directory is claimed when the first workers start, so an ``EventLog()`` without a path keeps
events in memory until it learns the directory: from :meth:`EventLog.attach`, or from the
first event with a ``run_dir`` field.

:func:`read_events` reads a log back (the chaos report and the failure summary use it).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from .._paths import Unsafe, check_file_dir, open_append
from .._safejson import loads

log = logging.getLogger("elastictk.metrics")

FILE_NAME = "events.jsonl"
ENVELOPE = ("seq", "kind", "time", "wall", "mono", "pid", "run_id", "node_id", "fields")


class EventLogError(RuntimeError):
    """An event log that cannot be written or read; the message names the path and the fix."""


@dataclass(frozen=True)
class Event:
    """One line of an event log."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)
    wall: float = 0.0
    mono: float = 0.0
    seq: int = 0
    pid: int = 0
    run_id: str | None = None
    node_id: str | None = None

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


def event_log_path(log_dir: str | os.PathLike[str], run_id: str) -> Path:
    """``<log_dir>/<run_id>/events.jsonl``."""
    return Path(log_dir) / run_id / FILE_NAME


def _plain(value: Any) -> Any:
    """JSON has no Path, enum, set or NaN: write what a reader can use."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(v) for v in value), key=str)
    if isinstance(value, enum.Enum):
        return value.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


class EventLog:
    """Appends events to ``path`` (or, without one, to the run directory once it is known)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, run_id: str | None = None,
                 node_id: str | None = None, buffer_limit: int = 10_000) -> None:
        self.run_id, self.node_id = run_id, node_id
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._path: Path | None = None
        self._pending: list[bytes] = []
        self._buffer_limit = buffer_limit
        self._dropped = 0
        self._seq = 0
        self._closed = False
        self._write_failed = False
        if path is not None:
            self.attach(path)

    @property
    def path(self) -> Path | None:
        return self._path

    def attach(self, path: str | os.PathLike[str]) -> Path:
        """Start writing to ``path`` (parents created mode 0700), first the events held so far.

        A log that is already attached keeps its file; the call then returns it unchanged.
        """
        with self._lock:
            if self._closed:
                raise EventLogError(f"event log {path} was closed; make a new EventLog")
            if self._fd is not None:
                assert self._path is not None
                return self._path
            target = Path(path)
            try:
                os.makedirs(target.parent, mode=0o700, exist_ok=True)
                # Another user's directory (or a symlink planted in /tmp) is refused, not
                # followed: the agent may run as root (_paths).
                check_file_dir(target.parent, "directory for the event log")
                fd = open_append(target, 0o600)  # the log names hosts, pids and paths
            except Unsafe as e:
                raise EventLogError(f"cannot write event log {target}: {e}") from None
            except OSError as e:
                raise EventLogError(f"cannot write event log {target}: {e.strerror or e}; "
                                    "pass a writable --event-log path or --log-dir") from None
            self._fd, self._path = fd, target
            pending, self._pending = self._pending, []
            for line in pending:
                self._write(line)
            if self._dropped:
                log.warning("event log %s: %d early event(s) were dropped (buffer full)",
                            target, self._dropped)
            return target

    def __call__(self, kind: str, **fields: Any) -> None:
        """Record one event; never raises (a full disk must not stop a training job)."""
        wall, mono = time.time(), time.monotonic()
        run_dir = fields.get("run_dir")
        if self._fd is None and run_dir and not self._closed:
            try:
                self.attach(Path(run_dir) / FILE_NAME)
            except EventLogError as e:
                self._warn_once(str(e))
        with self._lock:
            if self._closed:
                return
            if isinstance(fields.get("node_id"), str):
                self.node_id = fields["node_id"]
            self._seq += 1
            record = {
                "seq": self._seq, "kind": str(kind),
                "time": _dt.datetime.fromtimestamp(wall, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                "wall": round(wall, 6), "mono": round(mono, 6), "pid": os.getpid(),
                "run_id": self.run_id, "node_id": self.node_id, "fields": _plain(fields),
            }
            line = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()
            if self._fd is not None:
                self._write(line)
            elif len(self._pending) < self._buffer_limit:
                self._pending.append(line)
            else:
                self._dropped += 1

    on_event = __call__

    def _write(self, line: bytes) -> None:
        assert self._fd is not None
        try:
            view = memoryview(line)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError as e:
            self._warn_once(f"cannot write event log {self._path}: {e.strerror or e}")

    def _warn_once(self, message: str) -> None:
        if not self._write_failed:
            self._write_failed = True
            log.warning("%s; events are not being recorded", message)

    def close(self) -> None:
        """Close the file; events still held (no run directory was ever known) are discarded."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            elif self._pending:
                log.debug("event log: %d event(s) had no run directory to go to", len(self._pending))
            self._pending = []

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _event(record: Mapping[str, Any]) -> Event:
    fields = record.get("fields")
    return Event(
        kind=str(record["kind"]), fields=dict(fields) if isinstance(fields, dict) else {},
        wall=float(record.get("wall", 0.0)), mono=float(record.get("mono", 0.0)),
        seq=int(record.get("seq", 0)), pid=int(record.get("pid", 0)),
        run_id=record.get("run_id"), node_id=record.get("node_id"),
    )


def iter_events(path: str | os.PathLike[str]) -> Iterator[Event]:
    """The events of a log in file order.

    A last line without its newline that is not an event (its writer was killed mid-line) is
    skipped with one warning on the ``elastictk.metrics`` logger; any other line that is not an
    event raises :class:`EventLogError` naming the file and line.
    """
    p = Path(path)
    try:
        f = open(p, "rb")
    except OSError as e:
        raise EventLogError(f"cannot read event log {p}: {e.strerror or e}") from None
    with f:
        for number, raw in enumerate(f, 1):
            complete = raw.endswith(b"\n")
            if not raw.strip():
                continue
            try:
                record = loads(raw, max_bytes=None)  # bounded by the line: read already
                if not isinstance(record, dict) or "kind" not in record:
                    raise ValueError("no 'kind'")
                event = _event(record)
            except (ValueError, TypeError, KeyError, OverflowError) as e:
                if not complete:  # only the last line can lack its newline
                    log.warning("event log %s:%d: skipped a torn last line (%d bytes without a newline: "
                                "its writer was killed mid-line)", p, number, len(raw))
                    return
                raise EventLogError(f"{p}:{number}: not an elastictk event ({e}); "
                                    "is this an events.jsonl file?") from None
            yield event


def read_events(path: str | os.PathLike[str], kinds: set[str] | frozenset[str] | None = None) -> list[Event]:
    """Every event of the log (only ``kinds``, if given)."""
    return [e for e in iter_events(path) if kinds is None or e.kind in kinds]

"""Label values with a hard bound, and the pure classification of events into them.

A Prometheus series exists per distinct label set, forever; one label fed an unbounded value
(a PID, a step, a free-text reason) grows the exporter and the server without limit. Every
label value elastictk exports therefore comes from a closed set or from a
:class:`BoundedLabel`, which admits the first ``limit`` distinct values and maps the rest to
``"other"``.
"""
from __future__ import annotations

import re
import signal
import threading
from typing import Any, Iterable

OTHER = "other"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]+")
_SIGNALS = frozenset(s.name for s in signal.Signals)

# worker_failures_total{reason}
EXIT_CODE, SIGNAL, TIMER_EXPIRED, LOST_NODE = "exit_code", "signal", "timer_expired", "lost_node"
FAILURE_REASONS = (EXIT_CODE, SIGNAL, TIMER_EXPIRED, LOST_NODE, OTHER)
# membership_changes_total{cause}
NODE_JOINED, SHUTDOWN, STORE_LOST = "node_joined", "shutdown", "store_lost"
MEMBERSHIP_CAUSES = (NODE_JOINED, LOST_NODE, SHUTDOWN, STORE_LOST, OTHER)


def sanitize(value: Any, max_len: int = 48) -> str:
    """A short label-safe spelling of ``value`` (empty input becomes ``"none"``)."""
    text = _UNSAFE.sub("_", str(value)).strip("_")[:max_len]
    return text or "none"


class BoundedLabel:
    """Admits at most ``limit`` distinct values (``known`` ones always); the rest read ``other``."""

    def __init__(self, limit: int, known: Iterable[str] = ()) -> None:
        if limit < 1:
            raise ValueError(f"limit {limit}: must be at least 1")
        self.limit = limit
        self._known = frozenset(known)
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: Any) -> str:
        text = sanitize(value)
        if text in self._known or text == OTHER:
            return text
        with self._lock:
            if text in self._seen:
                return text
            if len(self._seen) < self.limit:
                self._seen.add(text)
                return text
        return OTHER

    @property
    def admitted(self) -> frozenset[str]:
        with self._lock:
            return self._known | frozenset(self._seen)


def exit_detail(exit: Any) -> tuple[str, str]:
    """``(reason, detail)`` for a worker's exit as the agent reports it.

    Accepts ``"SIGKILL"``, ``"code 3"``, ``"exit code 3"``, ``3``, ``-9`` (a negative code is a
    signal, as in ``Popen.returncode``). Exit codes 0..255 and signal names are closed sets;
    anything else is ``("other", "other")``.
    """
    if isinstance(exit, bool):
        return OTHER, OTHER
    if isinstance(exit, int):
        code = exit
    else:
        text = str(exit).strip()
        name = text.upper()
        if not name.startswith("SIG") and ("SIG" + name) in _SIGNALS:
            name = "SIG" + name
        if name in _SIGNALS:
            return SIGNAL, name
        m = re.fullmatch(r"(?:exit\s+)?(?:code\s+)?(-?\d+)", text, re.IGNORECASE)
        if m is None:
            return OTHER, OTHER
        code = int(m.group(1))
    if code < 0:
        try:
            return SIGNAL, signal.Signals(-code).name
        except ValueError:
            return SIGNAL, OTHER
    return (EXIT_CODE, str(code)) if code <= 255 else (EXIT_CODE, OTHER)


def membership_cause(reason: Any) -> str:
    """Classify the agent's one-line membership reason (its wording is the watch's)."""
    text = str(reason or "").lower()
    if "heartbeat" in text:
        return LOST_NODE
    if "store" in text:
        return STORE_LOST
    if "lost" in text and "node" in text:
        return LOST_NODE
    if "opened" in text or "arrived" in text or "joined" in text:
        return NODE_JOINED
    if "shut down" in text or "shutdown" in text:
        return SHUTDOWN
    return OTHER

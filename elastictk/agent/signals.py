"""The agent's signals: which end it, which it forwards to its workers, and waits they cut short.

Apart from the loop because it is the one part that runs inside a signal handler: it only
records the signal and wakes whoever waits (the rendezvous, a start in progress, the monitor),
and the loop acts on it at its next look. A restart backoff is such a wait.
"""
from __future__ import annotations

import signal
import threading
import time
from typing import Any, Callable, Iterable

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
TERMINATING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Signals:
    """The signals one agent catches. ``received`` is the last one, until the loop takes it.

    A signal in ``stopping`` calls ``on_stop`` (interrupt the waits that would not end
    otherwise); any other calls ``on_other`` (wake the monitor, which forwards it)."""

    def __init__(self, stopping: Iterable[int], on_stop: Callable[[], None],
                 on_other: Callable[[], None]) -> None:
        self.stopping = tuple(dict.fromkeys(TERMINATING + tuple(stopping)))
        self.received: int | None = None
        self._on_stop, self._on_other = on_stop, on_other
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        """Catch them (only the main thread can)."""
        if threading.current_thread() is threading.main_thread():
            for sig in dict.fromkeys(FORWARDED + self.stopping):
                self._old[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    @property
    def stop(self) -> bool:
        """A signal that ends the agent came."""
        return self.received in self.stopping

    def stop_reason(self) -> str | None:
        """Why the agent must stop waiting, if a terminating signal came."""
        sig = self.received
        return f"the agent received {signal.Signals(sig).name}" if sig in self.stopping else None

    def backoff(self, seconds: float) -> None:
        """A wait (the restart backoff), cut short by a terminating signal (the loop then acts on it)."""
        deadline = time.monotonic() + seconds
        while self.stop_reason() is None and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(0.2, left))

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signum
        if signum in self.stopping:
            self._on_stop()
        else:
            self._on_other()

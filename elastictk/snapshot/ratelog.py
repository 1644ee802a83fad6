"""One log line per cause per interval, however often the cause recurs.

A server that logs every bad connection lets anyone who reaches its port fill the disk; one
that logs a cause only the first time hides that it is still happening. So a cause is logged
at most once per :attr:`RateLimitedLog.every` seconds, and the next line for it says how many
were left out in between.
"""
from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, prefix: str, every: float = 60.0) -> None:
        self.logger, self.prefix, self.every = logger, prefix, every
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warn(self, cause: str, line: str, level: int = logging.WARNING) -> bool:
        """Log ``line`` unless ``cause`` was logged less than ``every`` seconds ago; whether it was."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(cause)
            if last is not None and now - last < self.every:
                self._quiet[cause] = self._quiet.get(cause, 0) + 1
                return False
            if len(self._last) > 1024:  # causes carry addresses: keep the table bounded
                self._last = {c: t for c, t in self._last.items() if now - t < self.every}
            self._last[cause] = now
            quiet = self._quiet.pop(cause, 0)
        more = f" ({quiet} more like it in the last {self.every:g} s not logged)" if quiet else ""
        self.logger.log(level, "%s: %s%s", self.prefix, line, more)
        return True

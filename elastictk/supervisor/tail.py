"""The interesting end of a worker's log, for a failure report when there is no error file.

The last lines of stderr usually say what went wrong; but a faulthandler dump or a Python
traceback that started a little higher up is worth showing whole, from its header.
"""
from __future__ import annotations

import errno
import os
import stat
from typing import Sequence

TAIL_LINES = 20
# A Python traceback or a faulthandler dump that starts within this many lines of the end is
# shown whole (up to this many lines) rather than cut at TAIL_LINES.
MAX_TAIL_LINES = 60
_TAIL_BYTES = 256 * 1024
_MARKERS = ("Fatal Python error:", "Traceback (most recent call last):")


def pick_tail(lines: Sequence[str], n: int = TAIL_LINES, cap: int = MAX_TAIL_LINES) -> list[str]:
    """The last ``n`` lines, or more when a traceback or fault dump starts just above them.

    Pure, so the choice is testable without files: a faulthandler dump is shown from its
    ``Fatal Python error:`` header, a Python traceback from its first line, either capped.
    """
    lines = list(lines)
    while lines and not lines[-1].strip():
        lines.pop()
    window_start = max(0, len(lines) - cap)
    for marker in _MARKERS:
        hits = [i for i in range(window_start, len(lines)) if lines[i].startswith(marker)]
        if hits:
            start = hits[0] if marker == _MARKERS[0] else hits[-1]
            if start < len(lines) - n:
                return lines[start:start + cap]
            break
    return lines[-n:] if n > 0 else []


def read_tail(path: str, n: int = TAIL_LINES, cap: int = MAX_TAIL_LINES) -> list[str]:
    """The interesting end of a log file (see ``pick_tail``); raises ``OSError`` if unreadable."""
    if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO or a tty would block the report
        raise OSError(errno.EINVAL, "not a regular file", path)
    with open(path, "rb") as fp:
        fp.seek(0, os.SEEK_END)
        size = fp.tell()
        fp.seek(max(0, size - _TAIL_BYTES))
        blob = fp.read()
    lines = blob.decode("utf-8", errors="replace").splitlines()
    if size > _TAIL_BYTES and lines:
        lines = lines[1:]  # the first line read is likely cut in the middle
    return pick_tail(lines, n, cap)

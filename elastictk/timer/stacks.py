"""Reading a faulthandler dump: the threads, and the line of user code a stuck rank sits on.

faulthandler is used because it works when nothing else does: its handler is async-signal-safe
C that walks every thread's frames without the GIL, so it dumps a worker blocked inside a C++
collective just as well as one spinning in Python. Its output, per thread::

    Thread 0x00007f28968d06c0 (most recent call first):
      File "/path/train.py", line 57 in main
    Current thread 0x00007f28975efb80 (most recent call first):
      ...

"Where was it stuck" is the innermost frame that belongs to the user: frames inside torch,
elastictk and the standard library are the machinery, not the answer.
"""
from __future__ import annotations

import os
import re
import sysconfig
from dataclasses import dataclass
from typing import Optional, Sequence

_THREAD = re.compile(r"^(Current thread|Thread) 0x([0-9a-fA-F]+) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+|\?\?\?) in (.*)$')

# Frames that are never where the user's code stands: torch, and elastictk's own wrappers around
# the collectives (timers in timer/, progress marks and straggler timing in metrics/).
_LIBRARY_PARTS = (f"{os.sep}torch{os.sep}", f"{os.sep}elastictk{os.sep}timer{os.sep}",
                  f"{os.sep}elastictk{os.sep}supervisor{os.sep}", f"{os.sep}elastictk{os.sep}metrics{os.sep}")


def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    keys = ("stdlib", "platstdlib")
    return tuple({os.path.realpath(paths[k]) + os.sep for k in keys if k in paths})


_STDLIB = _stdlib_dirs()


@dataclass(frozen=True)
class Frame:
    filename: str
    lineno: int  # 0 when faulthandler printed "???"
    name: str

    def short(self) -> str:
        """``train.py:57 (main)``."""
        return f"{os.path.basename(self.filename)}:{self.lineno} ({self.name})"

    @property
    def is_library(self) -> bool:
        path = self.filename
        if any(part in path for part in _LIBRARY_PARTS) or path.startswith("<frozen "):
            return True
        real = os.path.realpath(path) if os.path.isabs(path) else path
        return real.startswith(_STDLIB) and "-packages" not in real


@dataclass(frozen=True)
class ThreadStack:
    ident: int
    current: bool  # the thread that ran the signal handler
    frames: tuple[Frame, ...]  # innermost first, as faulthandler prints them


def parse(text: str) -> list[ThreadStack]:
    """Every thread of a dump; lines that are not part of one are ignored."""
    threads: list[ThreadStack] = []
    ident, current, frames = None, False, []  # type: ignore[var-annotated]
    for line in text.splitlines():
        m = _THREAD.match(line)
        if m:
            if ident is not None:
                threads.append(ThreadStack(ident, current, tuple(frames)))
            ident, current, frames = int(m.group(2), 16), m.group(1) == "Current thread", []
            continue
        f = _FRAME.match(line)
        if f and ident is not None:
            lineno = 0 if f.group(2) == "???" else int(f.group(2))
            frames.append(Frame(f.group(1), lineno, f.group(3)))
    if ident is not None:
        threads.append(ThreadStack(ident, current, tuple(frames)))
    return threads


def _mentions(thread: ThreadStack, scope: str) -> bool:
    base = scope.split("(", 1)[0]
    return any(fr.name in (scope, base) for fr in thread.frames)


def culprit(threads: Sequence[ThreadStack], scope: str,
            main_thread: int = 0) -> tuple[Optional[ThreadStack], Optional[Frame]]:
    """The thread that most likely holds the expired timer, and its innermost user frame.

    A thread whose stack has a function named like the scope (``all_reduce``) wins; else the
    main thread; else the first thread with any frame. The frame is the innermost one outside
    torch, elastictk and the standard library, or the innermost of all if every frame is there.
    """
    with_frames = [t for t in threads if t.frames]
    if not with_frames:
        return None, None
    chosen = (next((t for t in with_frames if _mentions(t, scope)), None)
              or next((t for t in with_frames if t.ident == main_thread), None)
              or with_frames[0])
    frame = next((fr for fr in chosen.frames if not fr.is_library), chosen.frames[0])
    return chosen, frame

"""A rank's stacks, and the line it is stuck on: what a hang report shows of each rank.

Apart from the progress watchdog (``progress.py``, when a rank is hung) and the hang itself
(``hang.py``, what is reported) because it is the one place that reaches into another
process to see where it stands: through the timer region, where faulthandler in the worker
writes the dump (``timer/dumps.py``; a running rank that attached its region), else
``py-spy dump`` from outside (a stopped process, read without pausing it, or one that did
not answer). A dump is reduced to its innermost user frame (``train.py:57 (main)``), the
library frames (torch, elastictk's own wrappers) skipped.
"""
from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Mapping, Optional

from ..lifetime.procfs import read_stat
from ..timer.stacks import Frame, parse

log = logging.getLogger("elastictk.agent")

PYSPY_TIMEOUT = 10.0  # seconds one py-spy dump may take
StackDumper = Callable[[list[int]], Mapping[int, tuple[int, str, str]]]
_PYSPY_FRAME = re.compile(r"^\s+(.*) \((.*):(\d+)\)\s*$")


def proc_state(pid: int) -> str:
    """The process's /proc state letter (R, S, D, T, ...); "?" once it is gone."""
    st = read_stat(pid)
    return "?" if st is None else st.state


def dump(pids: Mapping[int, int], states: Mapping[int, str],
         stacks: Optional[StackDumper]) -> dict[int, tuple[str, str, Optional[str]]]:
    """Local rank (``pids``: local rank -> PID) -> (stacks, where they came from, innermost
    user frame): through the timer region (``stacks``) for a rank that can run faulthandler,
    else, or where it did not answer, ``py-spy``."""
    running = [lr for lr in sorted(pids) if states[lr] not in ("T", "t", "Z", "?")]
    got: Mapping[int, tuple[int, str, str]] = {}
    if stacks is not None and running:
        try:
            got = stacks(running)
        except Exception:  # noqa: BLE001 - fall back to py-spy
            log.exception("stack dump through the timer region failed")
    out: dict[int, tuple[str, str, Optional[str]]] = {}
    for lr, pid in pids.items():
        text = got.get(lr, (0, "", ""))[1]
        if text.strip():
            out[lr] = (text, "faulthandler", where_faulthandler(text))
            continue
        text, note = pyspy_dump(pid, stopped=states[lr] in ("T", "t"))
        out[lr] = (text, "py-spy" if text else note, where_pyspy(text) if text else None)
    return out


def where_faulthandler(text: str) -> Optional[str]:
    """Innermost user frame of the current thread in a faulthandler dump (else the first)."""
    threads = [t for t in parse(text) if t.frames]
    if not threads:
        return None
    chosen = next((t for t in threads if t.current), threads[0])
    frame = next((f for f in chosen.frames if not f.is_library), chosen.frames[0])
    return frame.short()


def where_pyspy(text: str) -> Optional[str]:
    """Innermost user frame of the first thread in a ``py-spy dump`` (the main thread)."""
    frames: list[Frame] = []
    for line in text.splitlines():
        if line.startswith("Thread ") and frames:
            break
        m = _PYSPY_FRAME.match(line)
        if m:
            frames.append(Frame(m.group(2), int(m.group(3)), m.group(1)))
    if not frames:
        return None
    return next((f for f in frames if not f.is_library), frames[0]).short()


def pyspy_path() -> Optional[str]:
    """py-spy next to this interpreter (a venv's bin), else on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def pyspy_dump(pid: int, *, stopped: bool, native: bool = False) -> tuple[str, str]:
    """``py-spy dump`` of ``pid``: (text, "") or ("", one line saying why there is none).

    A stopped process cannot be suspended by ptrace the usual way, so it is read without
    pausing (``--nonblocking``); a running one is paused for a consistent dump, and read
    without pausing if that fails.
    """
    exe = pyspy_path()
    if exe is None:
        return "", "stacks not available: py-spy is not installed (pip install py-spy)"
    tries = [["--nonblocking"]] if stopped else [[], ["--nonblocking"]]
    if native and not stopped:  # the C++ frames too (a backend's connect, a store wait); else without
        tries = [["--native"], *tries]
    why = ""
    for extra in tries:
        try:
            p = subprocess.run([exe, "dump", "--full-filenames", *extra, "--pid", str(pid)],
                               capture_output=True, text=True, timeout=PYSPY_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as e:
            why = str(e)
            continue
        if p.returncode == 0 and p.stdout.strip():
            return p.stdout, ""
        lines = [ln for ln in (p.stderr or p.stdout).splitlines() if ln.strip()]
        why = lines[0] if lines else f"exit {p.returncode}"
    if "ermission" in why or "ptrace" in why.lower():
        why += " (ptrace is not permitted: see /proc/sys/kernel/yama/ptrace_scope or CAP_SYS_PTRACE)"
    return "", f"stacks not available: py-spy: {why}"

"""Reading another process's command line in tests that poll a tree of children: a child can end
(or be a zombie not yet reaped) between the listing and the read, which is not a failure."""
from __future__ import annotations

import psutil


def cmdline(proc: psutil.Process) -> str:
    """``proc``'s argv joined by spaces; empty for a process that ended or is a zombie."""
    try:
        return " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return ""

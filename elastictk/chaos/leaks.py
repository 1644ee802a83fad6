"""What a chaos run left behind: its processes still alive after it, and the shared-memory
segments and listening ports that were not there before it started.

Apart from the runner (``runner.py``), which takes the "before" picture and calls
:func:`record_leaks` at the end, and shared with the nodes' runner (``multinode.py``): the
report's "nothing outlives the run" checks read what this finds.
"""
from __future__ import annotations

import os
import time
from typing import Optional

import psutil

from ..lifetime import procfs
from .record import RunRecord


def record_leaks(rec: RunRecord, shm_before: set[str], ports_before: dict[str, Optional[int]]) -> None:
    """What the run left behind: its processes still alive, shared memory, listening ports."""
    grace = time.monotonic() + 5  # workers die with their agent by a death signal: a moment
    while _survivors(rec.pids) and time.monotonic() < grace:
        time.sleep(0.05)
    rec.leaked_processes = _survivors(rec.pids)
    rec.leaked_shm = sorted(s for s in _shm() - shm_before if s.startswith(("elastictk", "etk")))
    rec.leaked_ports = sorted(f"{addr} (pid {pid})" for addr, pid in _listening().items()
                              if addr not in ports_before and pid in rec.pids)


def _survivors(pids: set[int]) -> list[str]:
    out = []
    for pid in sorted(pids):
        st = procfs.read_stat(pid)
        if st is not None and st.state != "Z":
            out.append(f"pid {pid} ({(procfs.cmdline(pid) or '')[:80]})")
    return out


def _listening() -> dict[str, Optional[int]]:
    """Listening TCP sockets on this host: ``addr:port`` → owning PID (None if unknown)."""
    try:
        conns = psutil.net_connections("tcp")
    except (psutil.AccessDenied, OSError):
        return {}
    return {f"{c.laddr.ip}:{c.laddr.port}": c.pid for c in conns if c.status == psutil.CONN_LISTEN}


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()

"""What an in-place generation that never formed leaves behind: how far it got, and every stack.

When the agent gives up on a generation (its re-form deadline passed) it falls back to
restart-all, which kills the workers: whatever kept them from forming (a replacement stuck in
an import, a survivor in a backend call, a connect that never completed) goes with them. So
before the fallback the agent writes ``inplace_unformed.txt`` in the attempt's log directory:
how many ranks had joined the generation (its ``joined`` counter) and each local worker's
``/proc`` state and stacks, Python and native (py-spy pauses it for a moment: a backend's
connect loop or a store wait shows; a process it cannot read is named with why), and the
fallback's line points at it. Like the hang report, this is this node's view; each node's
agent writes its own.
"""
from __future__ import annotations

import socket
from pathlib import Path
from typing import Mapping, Optional

from .hang import save_report
from .rankstacks import proc_state, pyspy_dump, where_pyspy

REPORT = "inplace_unformed.txt"


def joined_count(raw: Optional[bytes]) -> Optional[int]:
    """The generation's ``joined`` counter (a store ``add``; absent: nobody joined yet), None
    when it is not a count."""
    if raw is None:
        return 0
    try:
        n = int(raw)
    except ValueError:
        return None
    return n if 0 <= n < 1 << 31 else None


def summary(gen: int, joined: Optional[int], world: int) -> str:
    """``0 of 2 ranks had joined generation 1`` (pure)."""
    got = "an unreadable count of" if joined is None else f"{joined} of"
    return f"{got} {world} ranks had joined generation {gen}"


def report_unformed(report_dir: Optional[Path], gen: int, joined: Optional[int], world: int,
                    pids: Mapping[int, int], ranks: Mapping[int, int], waited: str) -> Optional[str]:
    """Write the report; its path, or None without a directory or where it cannot be written."""
    if report_dir is None:
        return None
    lines = [f"in-place generation {gen} not ready within {waited} on {socket.gethostname()}: "
             f"{summary(gen, joined, world)}; falling back to restart-all", ""]
    for lr, pid in sorted(pids.items()):
        state = proc_state(pid)
        text, why = pyspy_dump(pid, stopped=state in ("T", "t"), native=True)
        where = where_pyspy(text) if text else None
        lines += [f"== rank {ranks.get(lr, lr)} (local {lr}, pid {pid}, state {state})"
                  f"{', at ' + where if where else ''}; stacks from {'py-spy' if text else why}",
                  text.rstrip() or "(no stacks)", ""]
    return save_report(report_dir, REPORT, lines, "in-place report")


__all__ = ["REPORT", "joined_count", "report_unformed", "summary"]

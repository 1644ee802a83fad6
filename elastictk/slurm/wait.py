"""A node that does not host the job's c10d store waits for the node that does.

Every task of an ``srun`` step starts at once, and the first node's agent needs a second or
two (importing torch) before its store listens; elastictk's store client fails at once when
nothing listens (the right answer for a mistyped endpoint). So under Slurm's defaults a
node that is not the host first waits, up to the rendezvous join timeout, for a TCPStore to
answer there. Nothing signals "the port is open" across hosts, so this is the one place a
connect is retried: every 0.2 s, each try a connect and a TCPStore ping (no key is touched).
"""
from __future__ import annotations

import time
from typing import Callable

from ..store.endpoint import Endpoint
from ..store.listen import ping_store

RETRY = 0.2


def wait_for_store(endpoint: Endpoint, seconds: float, say: Callable[[str], None],
                   ping: Callable[[Endpoint, float], str | None] = ping_store) -> bool:
    """True once a TCPStore answers at ``endpoint``; False after ``seconds`` (the caller's
    own open then fails with its one line). Says once that it waits, if it has to."""
    deadline = time.monotonic() + seconds
    said = False
    while True:
        reason = ping(endpoint, 1.0)
        if reason is None:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if not said:
            say(f"waiting up to {seconds:g}s for the store at {endpoint} (its node's agent starts "
                f"it): {reason}")
            said = True
        time.sleep(min(RETRY, left))

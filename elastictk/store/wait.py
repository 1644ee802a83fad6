"""A client of a c10d store waits for the store's host to listen, as torch's client does.

Nodes of a job start in any order (``srun`` starts every task at once, a scheduler starts
pods as they are placed), and the node hosting the store needs a second or two, importing
torch, before it listens. torch's ``TCPStore`` client retries its connect for the whole
timeout (``read_timeout``, 60 s under torchrun), so torchrun's other nodes wait for the host;
elastictk's do too, and say once that they wait and for what. Only a connect that nothing took
is retried: a program on the port that does not answer as a TCPStore is reported at once, as
waiting cannot change it. Each try is a connect and a ping (no key is touched), every 0.2 s.
"""
from __future__ import annotations

import time
from typing import Callable

from .endpoint import Endpoint
from .listen import probe_store

RETRY = 0.2
#: The longest one try may take: a connect nothing answers (a dropped SYN), then the ping.
TRY = 5.0

Probe = Callable[[Endpoint, float], "tuple[str | None, bool]"]


def wait_for_store(endpoint: Endpoint, seconds: float, say: Callable[[str], None],
                   probe: Probe = probe_store, setting: str = "--rdzv-conf read_timeout") -> str | None:
    """``None`` once a TCPStore answers at ``endpoint``; else why not, at once for an answer
    that is not a TCPStore's, after ``seconds`` for a connect that nothing takes. Says once
    that it waits, if it has to (naming ``setting``, what sets ``seconds``)."""
    deadline = time.monotonic() + seconds
    said = False
    while True:
        reason, nothing_there = probe(endpoint, max(0.05, min(TRY, deadline - time.monotonic())))
        if reason is None or not nothing_there:
            return reason
        left = deadline - time.monotonic()
        if left <= 0:
            return reason
        if not said:
            say(f"waiting up to {seconds:g}s for the store at {endpoint} (its node's agent starts "
                f"it; {setting}): {reason}")
            said = True
        time.sleep(min(RETRY, left))

"""What a node waiting for a round says while it waits: who has joined, how many more are
needed, and how long until the join timeout.

Without it a multi-node start that waits for a late node prints nothing after
``rendezvous_started`` for up to the join timeout (ten minutes by default). The line is built
from what the waiting node reads anyway (the round's arrival counter, its own deadline), and
throttled: the first after :data:`FIRST_AFTER` seconds (a round that forms quickly says
nothing), then every :data:`EVERY` seconds for the first minute, every :data:`LATER` after.
"""
from __future__ import annotations

from dataclasses import dataclass

FIRST_AFTER = 5.0
EVERY = 5.0
LATER = 30.0
FAST_FOR = 60.0  # how long the short interval lasts


def waiting_line(round_no: int, joined: int, min_nodes: int, max_nodes: int, left: float,
                 last_call: float, job_id: str | None = None) -> str:
    """One line for a node waiting on round ``round_no`` with ``joined`` arrivals so far and
    ``left`` seconds to its join timeout; pure. Alone under ``job_id``, it says so: a node
    given another ``--rdzv-id`` waits under its own id and cannot be seen from here."""
    left_s = f"{max(left, 0.0):.0f} s left of --rdzv-conf join_timeout"
    if joined < min_nodes:
        more = min_nodes - joined
        alone = (f"; no other node has joined rdzv-id {job_id!r} yet: every node needs the same "
                 "--rdzv-id and --rdzv-endpoint" if joined <= 1 and job_id is not None else "")
        return (f"waiting for nodes: {joined} of min {min_nodes} joined (round {round_no}), "
                f"{more} more needed; {left_s}{alone}")
    return (f"waiting for nodes: {joined} joined, min {min_nodes} met (round {round_no}); it "
            f"closes when max {max_nodes} have joined, or --rdzv-conf last_call_timeout "
            f"({last_call:g} s) after the min was met")


@dataclass
class WaitingReporter:
    """When the next waiting line is due, for one wait that began at ``since``."""

    since: float
    _next: float | None = None

    def due(self, now: float) -> bool:
        """Whether a line is due at ``now``; if so, the one after is scheduled."""
        at = self.since + FIRST_AFTER if self._next is None else self._next
        if now < at:
            return False
        self._next = now + (EVERY if now - self.since < FAST_FOR else LATER)
        return True

"""Rendezvous failures, each carrying one line that says what happened and what to do."""
from __future__ import annotations


class RendezvousError(RuntimeError):
    """Base class of every rendezvous failure."""


class RendezvousTimeout(RendezvousError, TimeoutError):
    """Not enough nodes joined within the join timeout."""


class RendezvousClosed(RendezvousError):
    """The job has ended (finished, or given up); a node arriving now has nothing to join.

    ``succeeded``: the job ended because its workers finished, so a node that ran nothing of it
    may still report success; False when it gave up (a late node then reports the failure)."""

    def __init__(self, message: str, *, succeeded: bool = True) -> None:
        super().__init__(message)
        self.succeeded = succeeded


class RoundAbandoned(RendezvousError):
    """The round closed, but a member this node needs died before doing its part (group rank 0
    never published the workers' master address): this node moves on to the next round."""


class RendezvousInterrupted(RendezvousError):
    """``interrupt()`` was called (the agent got SIGTERM) while this node waited for a round."""


class RendezvousStateError(RendezvousError):
    """The store holds something that is not elastictk rendezvous state (names the key)."""


class RendezvousAuthError(RendezvousStateError):
    """A record is not signed with the job's token, or this node does not know the token."""

"""Rendezvous failures, each carrying one line that says what happened and what to do."""
from __future__ import annotations


class RendezvousError(RuntimeError):
    """Base class of every rendezvous failure."""


class RendezvousTimeout(RendezvousError, TimeoutError):
    """Not enough nodes joined within the join timeout."""


class RendezvousClosed(RendezvousError):
    """The job has finished (or was shut down); a node arriving now has nothing to join."""


class RendezvousStateError(RendezvousError):
    """The store holds something that is not elastictk rendezvous state (names the key)."""


class RendezvousAuthError(RendezvousStateError):
    """A record is not signed with the job's token, or this node does not know the token."""

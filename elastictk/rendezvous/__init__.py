"""Membership rounds over any store: min/max nodes, agreed ranks, heartbeats, shutdown."""
from .config import RendezvousConfig
from .errors import (
    RendezvousAuthError, RendezvousClosed, RendezvousError, RendezvousInterrupted, RendezvousStateError,
    RendezvousTimeout, RoundAbandoned,
)
from .handler import RendezvousHandler, RoundInfo, default_node_id
from .records import Member, RoundResult
from .watch import MembershipWatch

__all__ = [
    "Member", "MembershipWatch", "RendezvousAuthError", "RendezvousClosed", "RendezvousConfig",
    "RendezvousError", "RendezvousInterrupted", "RendezvousHandler", "RendezvousStateError",
    "RendezvousTimeout", "RoundAbandoned", "RoundInfo", "RoundResult", "default_node_id",
]

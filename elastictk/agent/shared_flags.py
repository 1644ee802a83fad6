"""Flags every node of a job must be given alike, compared when a round closes.

``--nnodes`` and ``--max-restarts`` given differently on two nodes were silently each node's
own: one closed rounds the other would not, one gave up while the other restarted. Each node
puts its values in its join record's ``meta``; a node that is not rank 0 compares them with
rank 0's (which every node reads anyway: ``RoundInfo.master``), so nothing read grows with the
job. A difference is one line naming both values and the node they came from.

Pure: :func:`shared_flags` and :func:`mismatch` over plain values. What rank 0's record holds
came through the store: a value of the wrong type (or from a node that does not say) is absent,
and what is shown of it is bounded.
"""
from __future__ import annotations

from typing import Any, Mapping

#: meta key -> the flag a user gives it with.
FLAGS = {"nnodes": "--nnodes", "max_restarts": "--max-restarts"}


def shared_flags(min_nodes: int, max_nodes: int, max_restarts: int) -> dict[str, Any]:
    """This node's values, as its join record carries them."""
    nnodes = str(min_nodes) if min_nodes == max_nodes else f"{min_nodes}:{max_nodes}"
    return {"nnodes": nnodes, "max_restarts": int(max_restarts)}


def _readable(key: str, value: object) -> bool:
    if key == "nnodes":  # shown in the line: MIN[:MAX] digits only, never a peer's raw text
        return isinstance(value, str) and 0 < len(value) <= 41 and value.replace(":", "").isdigit() \
            and value.isascii()
    return isinstance(value, int) and not isinstance(value, bool)


def mismatch(mine: Mapping[str, Any], leader: Mapping[str, Any]) -> str | None:
    """One line naming the first flag whose value differs from rank 0's, or None."""
    for key, flag in FLAGS.items():
        theirs = leader.get(key)
        if not _readable(key, theirs) or theirs == mine.get(key):
            continue
        return (f"{flag} differs between this job's nodes: {flag} {mine.get(key)} on {_host(mine)}, "
                f"{flag} {theirs} on rank 0's {_host(leader)}; give every node the same {flag} "
                "and relaunch them all")
    return None


def rank0_meta(info: Any) -> Mapping[str, Any]:
    """Rank 0's join record of round ``info``: ``RoundInfo.master`` where the round hands it
    to every node alone (O(1)), else from the member list."""
    master = getattr(info, "master", None)
    if isinstance(master, dict):
        return master
    return next((m.meta for m in getattr(info, "members", ()) if m.rank == 0), {})


def _host(meta: Mapping[str, Any]) -> str:
    host = meta.get("host")
    return f"host {host[:64]!r}" if isinstance(host, str) and host else "host (unnamed)"

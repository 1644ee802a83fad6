"""What the rendezvous keeps in the store: the key layout and its JSON records.

One key per node and per round, counters for arrival order: K joining nodes each write their own
slot and bump one counter once, instead of retrying a compare-and-set on one shared blob.

With a job token every JSON record carries a MAC (:mod:`elastictk.rendezvous.auth`).

Layout (under the job's prefix)::

    auth                    JSON: whether the job uses a token (signed with it), set by the first node
    latest                  counter: newest round opened (rounds start at 1)
    shutdown                JSON: the job finished; late joiners are told so
    r/<n>/arrivals          counter: arrival order in round n
    r/<n>/slot/<seq>        JSON NodeRecord of the seq-th arrival
    r/<n>/result            JSON RoundResult, written once by compare-and-set (read by the
                            next round's closer and by nodes that ask for the member list)
    r/<n>/to/<node_id>      JSON Assignment: the node's rank, the world size, rank 0's meta and
                            its ring neighbours; written in bulk by the closer after the result
                            (etcd: arrivals left out of the round get a note saying so)
    r/<n>/size              JSON RoundSize: the round closed with how many (and full or not);
                            written with the assignments, read by joiners instead of the result
    r/<n>/a/<node_id>       (etcd) JSON NodeRecord under the node's lease, instead of the counter
                            and slot: its create_revision orders the arrivals
    r/<n>/closer            (etcd) the node that closes round n, created if absent under its lease
    r/<n>/job/...           free for the round's members (worker store, failure flags)
    hb/<node_id>            counter: the node's heartbeat
    left/<node_id>          JSON: the node left on purpose
    lost/<node_id>          JSON: someone saw the node's heartbeat stop
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .._safejson import Unreadable, loads
from .auth import Signer
from .errors import RendezvousStateError

_OPEN = Signer(None)  # no token: nothing signed, nothing checked

SCHEMA = "elastictk.rdzv/1"


def round_key(n: int, *parts: str) -> str:
    return "/".join(("r", str(n)) + parts)


def slot_key(n: int, seq: int) -> str:
    return round_key(n, "slot", str(seq))


def arrival_key(n: int, node_id: str) -> str:
    """Where a node's arrival for round ``n`` lives on a store with ordered arrivals (etcd)."""
    return round_key(n, "a", node_id)


def closer_key(n: int) -> str:
    return round_key(n, "closer")


def to_key(n: int, node_id: str) -> str:
    return round_key(n, "to", node_id)


def size_key(n: int) -> str:
    return round_key(n, "size")


def hb_key(node_id: str) -> str:
    return f"hb/{node_id}"


@dataclass(frozen=True)
class NodeRecord:
    """One node's request to join a round."""

    node_id: str
    meta: dict[str, Any] = field(default_factory=dict)
    #: The round this node ran in until it came (None: none, or not known). A running round's
    #: watchers tell a member's return (re-form now) from a spare's arrival (wait) by this
    #: field alone, where each read the round's whole member list: O(N) per watcher, O(N^2)
    #: for a job whose every node re-forms at once.
    member_of: int | None = None

    def to_json(self, signer: Signer = _OPEN, key: str = "") -> bytes:
        body: dict[str, Any] = {"node_id": self.node_id, "meta": self.meta}
        if self.member_of is not None:
            body["member_of"] = self.member_of
        return _dump(body, signer, key)


@dataclass(frozen=True)
class Member:
    node_id: str
    rank: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundResult:
    """The membership of a closed round, or the note that the job was shut down."""

    round: int
    members: tuple[Member, ...] = ()
    shutdown: str | None = None

    def to_json(self, signer: Signer = _OPEN, key: str = "") -> bytes:
        body: dict[str, Any] = {"round": self.round}
        if self.shutdown is not None:
            body["shutdown"] = self.shutdown
        else:
            body["members"] = [
                {"node_id": m.node_id, "rank": m.rank, "meta": m.meta} for m in self.members
            ]
        return _dump(body, signer, key)

    def rank_of(self, node_id: str) -> int | None:
        for m in self.members:
            if m.node_id == node_id:
                return m.rank
        return None


@dataclass(frozen=True)
class Assignment:
    """What one node needs of a closed round, O(1) in the round's size: its rank, the world
    size, rank 0's meta (the master address) and its ring neighbours (the ranks before and
    after it, whose heartbeats it watches). ``extra`` is free for fields added later."""

    round: int
    rank: int
    world: int
    master: dict[str, Any] = field(default_factory=dict)
    ring: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self, signer: Signer = _OPEN, key: str = "") -> bytes:
        return _dump({"round": self.round, "rank": self.rank, "world": self.world, "master": self.master,
                      "ring": list(self.ring), "extra": self.extra}, signer, key)


def rank_ranges(members: "list[Member]") -> list[list[int]] | None:
    """Each member's worker ranks, in group-rank order: ``[first global rank, global world,
    first role rank, role world]`` from the ``role`` and ``nproc`` in its meta (torchrun's
    assignment: cumulative sums of the local world sizes); None when a member's meta lacks
    them (the reader then computes them from the member list with its own defaults)."""
    nodes = []
    for m in members:
        role, nproc = m.meta.get("role"), m.meta.get("nproc")
        if not (isinstance(role, str) and isinstance(nproc, int) and not isinstance(nproc, bool) and nproc >= 1):
            return None
        nodes.append((role, nproc))
    total = sum(n for _, n in nodes)
    role_total: dict[str, int] = {}
    for role, n in nodes:
        role_total[role] = role_total.get(role, 0) + n
    out, base, role_base = [], 0, dict.fromkeys(role_total, 0)
    for role, n in nodes:
        out.append([base, total, role_base[role], role_total[role]])
        base += n
        role_base[role] += n
    return out


def assignments(result: "RoundResult", successors: int = 2) -> dict[str, Assignment]:
    """Every member's assignment in ``result``: a pure function of the member list. ``ring``
    holds the next ``successors`` ranks' node ids (rank+1, rank+2, ...), never the node itself;
    ``extra["ranks"]`` the node's worker ranks (:func:`rank_ranges`), so no member needs the
    member list to start its workers."""
    members = sorted(result.members, key=lambda m: m.rank)
    k = len(members)
    master = members[0].meta if members else {}
    ranges = rank_ranges(members)
    out = {}
    for i, m in enumerate(members):
        ring = [members[(i + d) % k].node_id for d in range(1, successors + 1)]
        ring = [r for r in dict.fromkeys(ring) if r != m.node_id]
        extra = {} if ranges is None else {"ranks": ranges[i]}
        out[m.node_id] = Assignment(result.round, m.rank, k, master, tuple(ring), extra)
    return out


def decode_ranks(extra: dict[str, Any]) -> tuple[int, int, int, int] | None:
    """The worker ranks a closer put in an assignment's ``extra`` (None: absent or malformed)."""
    r = extra.get("ranks")
    if not (isinstance(r, list) and len(r) == 4 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
        return None
    base, world, role_base, role_world = r
    if not (0 <= base < world and 0 <= role_base < role_world <= world):
        return None
    return base, world, role_base, role_world


@dataclass(frozen=True)
class RoundSize:
    """That round ``round`` closed, with ``world`` members: what a joiner reads instead of the
    member list (whether to open the next round, whether it waits as a spare)."""

    round: int
    world: int

    def to_json(self, signer: Signer = _OPEN, key: str = "") -> bytes:
        return _dump({"round": self.round, "world": self.world}, signer, key)


def decode_size(key: str, raw: bytes, signer: Signer = _OPEN) -> RoundSize:
    data = _load(key, raw, signer)
    n, world = data.get("round"), data.get("world")
    if not (isinstance(n, int) and isinstance(world, int) and world >= 0):
        raise _bad(key, f"round {n!r} of size {world!r}")
    return RoundSize(n, world)


def decode_assignment(key: str, raw: bytes, signer: Signer = _OPEN) -> Assignment:
    data = _load(key, raw, signer)
    n, rank, world = data.get("round"), data.get("rank"), data.get("world")
    master, ring, extra = data.get("master", {}), data.get("ring", []), data.get("extra", {})
    if not (isinstance(n, int) and isinstance(rank, int) and isinstance(world, int) and 0 <= rank < world):
        raise _bad(key, f"rank {rank!r} of world {world!r}")
    if not (isinstance(master, dict) and isinstance(extra, dict) and isinstance(ring, list)
            and all(isinstance(r, str) for r in ring)):
        raise _bad(key, "master, ring or extra of the wrong type")
    return Assignment(n, rank, world, master, tuple(ring), extra)


def _dump(body: dict[str, Any], signer: Signer = _OPEN, key: str = "") -> bytes:
    """Schema-tagged JSON, with a MAC over ``key`` and the body when the job has a token."""
    sealed = signer.seal(key, {"schema": SCHEMA, **body})
    return json.dumps(sealed, separators=(",", ":"), sort_keys=True).encode()


def _load(key: str, raw: bytes, signer: Signer = _OPEN) -> dict[str, Any]:
    """The record at ``key``: never unpickled, only JSON; with a token its MAC is checked over
    the raw bytes before they are parsed, and again over what was parsed; errors name the key."""
    raw = bytes(raw)
    signer.check_raw(key, raw)
    return signer.check(key, _parse(key, raw))


def _parse(key: str, raw: bytes) -> dict[str, Any]:
    try:
        data = loads(raw)
    except Unreadable as e:
        raise RendezvousStateError(
            f"store key {key!r} holds {len(raw)} bytes that are not JSON ({e}); another "
            "program shares this store and job id: use a fresh --rdzv-id or clear the store"
        ) from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise RendezvousStateError(
            f"store key {key!r} holds foreign rendezvous state (schema {found!r}, expected "
            f"{SCHEMA!r}); use a fresh --rdzv-id or clear the store"
        )
    return data


def _bad(key: str, why: str) -> RendezvousStateError:
    return RendezvousStateError(
        f"store key {key!r} holds a malformed record ({why}); use a fresh --rdzv-id or clear the store"
    )


def decode_node(key: str, raw: bytes, signer: Signer = _OPEN) -> NodeRecord:
    data = _load(key, raw, signer)
    node_id, meta = data.get("node_id"), data.get("meta", {})
    if not isinstance(node_id, str) or not node_id:
        raise _bad(key, "node_id missing")
    if not isinstance(meta, dict):
        raise _bad(key, "meta is not an object")
    member_of = data.get("member_of")
    if member_of is not None and (type(member_of) is not int or not 0 < member_of < 2**53):
        raise _bad(key, "member_of is not a round number")
    return NodeRecord(node_id, meta, member_of)


def decode_result(key: str, raw: bytes, signer: Signer = _OPEN) -> RoundResult:
    data = _load(key, raw, signer)
    n = data.get("round")
    if not isinstance(n, int):
        raise _bad(key, "round missing")
    if "shutdown" in data:
        return RoundResult(n, shutdown=str(data["shutdown"]))
    members = data.get("members")
    if not isinstance(members, list):
        raise _bad(key, "members missing")
    out = []
    for m in members:
        if not (isinstance(m, dict) and isinstance(m.get("node_id"), str)
                and isinstance(m.get("rank"), int) and isinstance(m.get("meta", {}), dict)):
            raise _bad(key, f"member entry {m!r}")
        out.append(Member(m["node_id"], m["rank"], m.get("meta", {})))
    ranks = sorted(m.rank for m in out)
    if ranks != list(range(len(out))):
        raise _bad(key, f"ranks {ranks} are not 0..{len(out) - 1}")
    return RoundResult(n, tuple(out))


def encode_note(signer: Signer = _OPEN, key: str = "", **body: Any) -> bytes:
    return _dump(body, signer, key)


def decode_note(key: str, raw: bytes, signer: Signer = _OPEN) -> dict[str, Any]:
    return _load(key, raw, signer)

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
    r/<n>/result            JSON RoundResult, written once by compare-and-set
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


def hb_key(node_id: str) -> str:
    return f"hb/{node_id}"


@dataclass(frozen=True)
class NodeRecord:
    """One node's request to join a round."""

    node_id: str
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self, signer: Signer = _OPEN, key: str = "") -> bytes:
        return _dump({"node_id": self.node_id, "meta": self.meta}, signer, key)


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
    return NodeRecord(node_id, meta)


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

"""The keys an agent and its in-place workers share, and what a generation record says.

A *generation* is one process group of a rendezvous round: generation 0 is the one the workers
start in; every in-place recovery publishes the next. All keys live on the in-place store (a
TCPStore the agent of group rank 0 hosts, so that it outlives any worker) under the round's
prefix, which the workers get as ``ELASTICTK_INPLACE_PREFIX``::

    gen/<G>              JSON record of generation G (below); written once, by a
                         compare-and-set on the first number without one (:func:`publish`),
                         by the agent publishing it, or by the workers' rank 0 for a
                         ``finished`` record: the job ended
    g<G>/pg/...          the process group's own store keys (a fresh prefix per generation)
    g<G>/joined          counter of workers that formed G's group and synced the state
    g<G>/ready           set by the last of them: generation G trains; the value is the wall
                         time it did (``ready_value``), so the agent times a recovery to the
                         moment the group formed, not to when its watcher noticed
    g<G>/error           the first worker whose collective failed in G says so here

With a job token (``--rdzv-token``) the records (``gen/<G>``, ``g<G>/ready``, ``g<G>/error``)
are sealed (:class:`Sealer`) with a per-run key the agent derives from the token and the run's
nonce and hands its workers as ``ELASTICTK_INPLACE_KEY`` (never the token itself); a record
that does not verify reads as absent. The ``joined`` counters are not sealed; there is no
generation counter: the records themselves are numbered without gaps from 0, so the newest is
found by reading them (:func:`newest`), and nobody adds to a key a stranger may have filled
with garbage (torch's store drops a client whose ``add`` meets it).

Plain JSON, no torch: the agent reads this module without importing torch.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from .._safejson import MAX_RECORD_BYTES, loads_object

ENV_STORE = "ELASTICTK_INPLACE_STORE"
ENV_PREFIX = "ELASTICTK_INPLACE_PREFIX"
ENV_NODE = "ELASTICTK_INPLACE_NODE"  # the worker's agent (node id): its key in ``Generation.nodes``
ENV_FIRST_GEN = "ELASTICTK_INPLACE_FIRST_GEN"  # a joining worker's first generation
ENV_KEY = "ELASTICTK_INPLACE_KEY"  # token jobs: the run's in-place key (derived, not the token)
SCHEMA = "elastictk.inplace-generation/1"

def _count(value: object) -> int:
    """A whole number from a record; TypeError for anything else (a string, a float, a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{type(value).__name__} is not a whole number")
    return value


def newest(present: Callable[[int], bool], known: int) -> int:
    """The newest generation whose record is there (and, token jobs, verifies), given that
    ``known``'s is. Records are published without gaps (:func:`publish` claims the first free
    number only once the one before it is there), so a galloping search finds the end of the
    run in O(log n) reads however many generations a long job went through: one read when
    nothing is new. Bytes that do not verify end the run; nothing a stranger writes moves a
    reader past the last sealed record."""
    lo, step = known, 1
    while present(lo + step):
        lo += step
        step *= 2
    hi = lo + step  # not there
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if present(mid):
            lo = mid
        else:
            hi = mid
    return lo


def gen_key(g: int) -> str:
    return f"gen/{g}"


def pg_prefix(g: int) -> str:
    return f"g{g}/pg"


def joined_key(g: int) -> str:
    return f"g{g}/joined"


def ready_key(g: int) -> str:
    return f"g{g}/ready"


def ready_value(at: float) -> bytes:
    return repr(at).encode()


def ready_time(value: bytes | None) -> float | None:
    """When the generation formed (wall clock), or None for a value that does not say."""
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def error_key(g: int) -> str:
    return f"g{g}/error"


def round_prefix(job_id: str, round_: int, attempt: int) -> str:
    """Where one attempt's generations live; a new round or attempt never sees old keys."""
    return f"elastictk/inplace/{job_id}/r{round_}/a{attempt}"


SEAL_CONTEXT = b"elastictk-inplace-seal/1"  # the MAC's domain: bumped if what it covers changes
_MAC_LEN = 64  # hex digits of HMAC-SHA256
_CAS_TRIES = 100

log = logging.getLogger("elastictk.inplace")


class Sealer:
    """Seals and opens the in-place records under one prefix with the run's in-place key.

    Wire format of a sealed value: ``<64 hex digits>:<value>``, the hex being
    ``HMAC-SHA256(key, SEAL_CONTEXT + b"\\n" + full store key + b"\\n" + value)``: the MAC
    binds the key name, so a record cannot be replayed under another key (another generation,
    another round's prefix). ``Sealer(None, ...)`` (no token) seals nothing and believes all.
    Opening never raises: a value that does not verify is None (absent), warned about once
    per key.
    """

    def __init__(self, key: Optional[str], prefix: str) -> None:
        self._key = key.encode() if key else None
        self.prefix = prefix
        self._warned: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def name(self, key: str) -> str:
        """The full store key a MAC covers."""
        return f"{self.prefix}/{key}" if self.prefix else key

    def _mac(self, key: str, value: bytes) -> bytes:
        assert self._key is not None
        msg = b"\n".join((SEAL_CONTEXT, self.name(key).encode(), value))
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest().encode()

    def seal(self, key: str, value: bytes) -> bytes:
        return value if self._key is None else self._mac(key, value) + b":" + value

    def open(self, key: str, raw: Optional[bytes]) -> Optional[bytes]:
        """The value sealed in ``raw`` for ``key``; None when absent or it does not verify."""
        if raw is None or self._key is None:
            return raw
        raw = bytes(raw)
        if len(raw) > MAX_RECORD_BYTES + _MAC_LEN + 1:
            raw = b""  # larger than any record: fails the MAC check below, unread
        mac, sep, value = raw[:_MAC_LEN], raw[_MAC_LEN:_MAC_LEN + 1], raw[_MAC_LEN + 1:]
        if sep == b":" and hmac.compare_digest(mac, self._mac(key, value)):
            return value
        name = self.name(key)
        if name not in self._warned:
            self._warned.add(name)
            log.warning("ignored in-place store key %r: not sealed with this run's in-place key "
                        "(forged, replayed, or from another run)", name)
        return None

    def claim(self, key: str, value: bytes,
              cas: Callable[[Optional[bytes], bytes], Optional[bytes]]) -> tuple[bool, bytes]:
        """Compare-and-set ``value`` (sealed) into an absent ``key``: (whether we won, the value
        there now). Bytes that do not verify count as absent and are replaced. ``cas(expected,
        desired)`` is the store's compare-and-set (``expected`` None: absent), returning what
        the key holds after it (None: absent)."""
        mine = self.seal(key, value)
        expected: Optional[bytes] = None
        for _ in range(_CAS_TRIES):
            got = cas(expected, mine)
            if got is not None:
                got = bytes(got)
            if got == mine:
                return True, value
            current = self.open(key, got)
            if current is not None:
                return False, current
            # absent again, or bytes that do not verify: replace exactly those
            expected = None if got is None or got == expected else got
        raise RuntimeError(f"in-place store key {self.name(key)!r}: {_CAS_TRIES} compare-and-set conflicts")


@dataclass(frozen=True)
class Generation:
    """One generation: its number, world size, and the job's restart count when it formed.

    ``restart_count`` is the job-wide count of failures recovered from (in place or by
    restart-all), i.e. what a worker started now sees as ``TORCHELASTIC_RESTART_COUNT``.
    ``nodes`` maps each node (agent id) to the global rank of its local rank 0: when nodes
    leave or join in place, a surviving worker's rank is ``nodes[its node] + LOCAL_RANK``, so
    its new rank follows from the record alone, whichever generations it skipped. Empty means
    the ranks a worker started with hold.
    """

    gen: int
    world_size: int
    restart_count: int = 0
    reason: str = ""
    nodes: dict[str, int] = field(default_factory=dict)
    finished: bool = False  # the job ended here: a worker waiting for this generation is done

    def rank_of(self, node: str, local_rank: int, current: int) -> int | None:
        """This worker's rank in the generation; None when its node is not part of it."""
        if not self.nodes:
            return current
        base = self.nodes.get(node)
        return None if base is None else base + local_rank

    def to_json(self) -> bytes:
        return json.dumps({"schema": SCHEMA, **asdict(self)}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Generation":
        """The record in ``raw``; ValueError (one line) for anything else (parsed safely: a
        nested, huge or non-finite value is refused, never a RecursionError)."""
        try:
            d = loads_object(raw)
            if d.get("schema") != SCHEMA:
                raise ValueError("schema")
            nodes = d.get("nodes") or {}
            if not isinstance(nodes, dict):
                raise TypeError("nodes")
            g = cls(_count(d["gen"]), _count(d["world_size"]), _count(d.get("restart_count", 0)),
                    str(d.get("reason", ""))[:2000], {str(k): _count(v) for k, v in nodes.items()},
                    bool(d.get("finished", False)))
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"in-place generation record: expected JSON with schema {SCHEMA!r}, "
                             f"got {raw[:80]!r}") from None
        if g.gen < 0 or g.world_size < 1 or g.restart_count < 0 or any(
                not 0 <= b < g.world_size for b in g.nodes.values()):
            raise ValueError(f"in-place generation record out of range: {g}")
        return g


# Messages torch's backends raise when a peer died or hung (gloo: reset/closed connections and
# timeouts; NCCL: aborted or timed-out communicators). A RuntimeError that is none of these is
# the user's own bug and is not retried.
_PEER_FAILURE = re.compile(
    r"gloo|connection (reset|closed|refused)|broken pipe|timed out|timeout|nccl|"
    r"process ?group|communicator|socket|peer", re.IGNORECASE)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` from a training step means a peer failed (recover) or is the step's
    own bug (re-raise, so the worker fails and the agent sees why)."""
    if not isinstance(exc, RuntimeError):
        return False
    if type(exc).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError"):
        return True
    return bool(_PEER_FAILURE.search(str(exc)))


def shard(global_size: int, rank: int, world_size: int) -> range:
    """The global indices ``[0, global_size)`` this rank owns: contiguous, as even as possible.

    A function of (size, rank, world) only, so after any membership change the ranks of the new
    world together cover every index exactly once, whoever held which before.
    """
    if world_size < 1 or not 0 <= rank < world_size or global_size < 0:
        raise ValueError(f"shard: need 0 <= rank < world_size and size >= 0, got "
                         f"size={global_size} rank={rank} world={world_size}")
    base, extra = divmod(global_size, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def is_finished(raw: bytes) -> bool:
    """Whether an opened generation record is the workers' ``finished`` one (unreadable: no)."""
    try:
        return Generation.from_json(raw).finished
    except ValueError:
        return False


def newest_sealed(sealer: Sealer, read: Callable[[str], Optional[bytes]], known: int) -> int:
    """:func:`newest` over the records ``read(key)`` returns (keys under the sealer's prefix),
    a record that does not verify being absent."""
    return newest(lambda g: sealer.open(gen_key(g), read(gen_key(g))) is not None, known)


def publish(sealer: Sealer, read: Callable[[str], Optional[bytes]],
            cas: Callable[[str, Optional[bytes], bytes], Optional[bytes]], known: int,
            make: Callable[[int], Generation]) -> int:
    """Publish the generation after the newest there (from ``known`` on): claim the first
    number without a record, and the next when another agent's record won it. ``read(key)``
    and ``cas(key, expected, desired)`` are the store's, under the sealer's prefix. When the
    workers' ``finished`` record won the number, that number is returned as it is: the job
    ended, and a replacement started for it exits at once."""
    g = newest_sealed(sealer, read, known) + 1
    for _ in range(_CAS_TRIES):
        key = gen_key(g)
        won, current = sealer.claim(key, make(g).to_json(), lambda old, new: cas(key, old, new))
        if won or is_finished(current):
            return g
        g += 1
    raise RuntimeError(f"in-place store: {_CAS_TRIES} generations published at once after {known}")

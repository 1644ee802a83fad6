"""The peer tier's shared pace: which steps every agent ships, and when a step is whole everywhere.

**The cadence.** Every agent ships the same steps: those that are multiples of the job's cadence
K, a power of two (1 at a round's start: every step, as long as sends are quick). Each agent times
its sends against the steps it sees sealed (:class:`StepClock`); one that took longer than half of
K steps raises K to the smallest power of two that covers two such sends (:func:`covering`), for
the whole job, through one key of the round's store that only ever grows (:meth:`RoundKeys.raise_to`,
a compare-and-set). Agents read it once per send (:meth:`RoundKeys.cadence`), at most once a
second. Powers of two nest, so while a raise spreads the steps everyone ships are still common.

**Whole everywhere.** From K = 2 on, a sender whose targets all kept its parts of step s says so
(:meth:`RoundKeys.mark_whole`): a counter per step, or on etcd one key per node and step, counted
in one request (a counter there is a compare-and-set loop every node would race at once). A
receiver keeps the previous replica of a rank beside the new one until every node's part of that
step is whole (:meth:`RoundKeys.whole`): a node lost mid-send leaves its older step, and every
other node's part of it, where a restore can find them.

Keys live in the round's store (``rdzv/<job>/r/<n>/job/``), so each round starts again at K = 1.
A value there that is not what this module writes is refused in one line and ignored: a counter
is not sealed, and it sizes nothing but a cadence, which :data:`MAX_CADENCE` bounds.
"""
from __future__ import annotations

import logging
import math
import re
import time
from enum import Enum
from typing import Callable, Literal, Optional, Protocol, TypeVar

from ..store.base import StoreError

log = logging.getLogger("elastictk.snapshot")
CADENCE_KEY = "snapshot/cadence"
MAX_CADENCE = 1 << 16  # steps: past this a replica is no use as a restore point anyway
MAX_COUNT = 1 << 20  # nodes: a counter past this is not one of ours
READ_EVERY = 1.0  # seconds: the cadence is read once per send, at most this often
RAISE_TRIES = 8  # compare-and-set attempts to raise the cadence before giving up for this send
_DECIMAL = re.compile(rb"[0-9]{1,20}")
T = TypeVar("T")


class _Failed(Enum):
    FAILED = "failed"  # a store call that raised (None is an absent key)


_FAILED = _Failed.FAILED


class BadValue(ValueError):
    """A store value this module did not write; the message says what it is, in one line."""


class RoundStore(Protocol):
    """What the peer tier needs of the round's store (``elastictk.store.Store`` has it)."""

    def try_get(self, key: str) -> bytes | None: ...
    def set(self, key: str, value: bytes) -> None: ...
    def add(self, key: str, amount: int) -> int: ...
    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes | None: ...
    def delete(self, key: str) -> bool: ...
    def count(self, prefix: str) -> int: ...
    def clone(self) -> "RoundStore": ...
    def close(self) -> None: ...

    @property
    def lease_liveness(self) -> bool: ...


def whole_key(step: int) -> str:
    """The counter of the nodes whose parts of ``step`` are whole on every ring target."""
    return f"snapshot/whole/{step}"


def whole_node_key(step: int, node_id: str) -> str:
    """On a store with leases (etcd): one key per node instead of the counter."""
    return f"{whole_key(step)}/{node_id}"


def _decimal(raw: bytes | None, what: str, high: int) -> int:
    if not isinstance(raw, bytes) or not _DECIMAL.fullmatch(raw):
        shown = repr(raw[:40]) if isinstance(raw, bytes) else type(raw).__name__
        raise BadValue(f"{what} holds {shown}, not a decimal number")
    v = int(raw)
    if v > high:
        raise BadValue(f"{what} holds {v}, more than {high}")
    return v


def read_cadence(raw: bytes | None) -> int:
    """The cadence a store value says (absent: 1): a power of two in 1..:data:`MAX_CADENCE`;
    :class:`BadValue` in one line otherwise (pure)."""
    if raw is None:
        return 1
    k = _decimal(raw, "the cadence key", MAX_CADENCE)
    if k < 1 or k & (k - 1):
        raise BadValue(f"the cadence key holds {k}, not a power of two")
    return k


def read_count(raw: bytes | None) -> int:
    """A whole-step counter's value (absent: 0); :class:`BadValue` in one line otherwise."""
    return 0 if raw is None else _decimal(raw, "a whole-step counter", MAX_COUNT)


def covering(steps_per_send: float, k: int) -> int:
    """The cadence after a send that took ``steps_per_send`` steps at cadence ``k`` (pure): ``k``
    while a send takes at most half of ``k`` steps, else the smallest power of two that covers two
    such sends (at most :data:`MAX_CADENCE`). It never falls."""
    if not steps_per_send > k / 2 or math.isnan(steps_per_send):
        return k
    need = 2 * min(steps_per_send, MAX_CADENCE)
    return max(k, min(MAX_CADENCE, 1 << max(math.ceil(need) - 1, 0).bit_length()))


class StepClock:
    """Seconds per step, from the (step, time) of the newest seals an agent sees during a round;
    a step lower than the last seen (a restore went back) starts the count again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._first: Optional[tuple[int, float]] = None
        self._last: Optional[tuple[int, float]] = None

    def saw(self, step: int) -> None:
        now = self._clock()
        if self._last is None or step < self._last[0]:
            self._first = self._last = (step, now)
        elif step > self._last[0]:
            self._last = (step, now)

    def step_seconds(self) -> Optional[float]:
        """The mean time between the steps seen this round; None before two steps apart."""
        if self._first is None or self._last is None or self._last[0] - self._first[0] < 2:
            return None
        return max(self._last[1] - self._first[1], 0.0) / (self._last[0] - self._first[0])


class RoundKeys:
    """One round's cadence and whole-step keys, used by the replicator thread alone (over a
    connection of its own). Every store error or bad value is one line, once per cause, and the
    call reads as "nothing known": the cadence unchanged, a step not whole."""

    def __init__(self, store: RoundStore, node_id: str, nodes: int) -> None:
        self.store, self.node_id, self.nodes = store, node_id, nodes
        try:
            self.per_node = bool(store.lease_liveness)
        except Exception:  # noqa: BLE001 - a store that cannot say: the counter
            self.per_node = False
        self._marked: Optional[int] = None  # the step this node said whole last
        self._warned: set[str] = set()

    def _warn(self, cause: str, line: str) -> None:
        if cause not in self._warned:
            self._warned.add(cause)
            log.warning("snapshot peer tier: %s", line)

    def _call(self, what: str, fn: Callable[[], T]) -> T | Literal[_Failed.FAILED]:
        try:
            return fn()
        except (StoreError, OSError) as e:
            self._warn(f"store {what}", f"the round's store did not answer ({what}: {e}); the "
                       "peer tier goes on without it for now")
            return _FAILED

    def cadence(self) -> Optional[int]:
        """The job's cadence now; None when it cannot be read (a bad value: said once)."""
        raw = self._call("read the cadence", lambda: self.store.try_get(CADENCE_KEY))
        if raw is _FAILED:
            return None
        try:
            return read_cadence(raw)
        except BadValue as e:
            self._warn("bad cadence", f"{e}; ignored (the agents raise it to the cadence they need)")
            return None

    def raise_to(self, k: int) -> Optional[int]:
        """Raise the job's cadence to at least ``k`` (a bad value there is replaced); the cadence
        now, or None when the store did not take it."""
        for _ in range(RAISE_TRIES):
            raw = self._call("read the cadence", lambda: self.store.try_get(CADENCE_KEY))
            if raw is _FAILED:
                return None
            try:
                now = read_cadence(raw)
            except BadValue as e:
                self._warn("bad cadence", f"{e}; replaced by {k}")
                now = 0
            if now >= k:
                return now
            got = self._call("raise the cadence",
                             lambda: self.store.compare_set(CADENCE_KEY, raw, str(k).encode()))
            if got == str(k).encode():
                return k
            if got is _FAILED:
                return None
        return None

    def mark_whole(self, step: int) -> None:
        """This node's parts of ``step`` are whole on every target. The node that fills a step's
        counter deletes the counter of the step it said whole before (on etcd each node deletes
        its own key of that step), so a long job leaves a few keys, not one per step."""
        prev, self._marked = self._marked, step
        if self.per_node:
            self._call("say a step whole", lambda: self.store.set(whole_node_key(step, self.node_id), b"1"))
            if prev is not None and prev != step:
                self._call("delete a whole-step key", lambda: self.store.delete(whole_node_key(prev, self.node_id)))
            return
        n = self._call("say a step whole", lambda: self.store.add(whole_key(step), 1))
        if isinstance(n, int) and n >= self.nodes and prev is not None and prev != step:
            self._call("delete a whole-step counter", lambda: self.store.delete(whole_key(prev)))

    def whole(self, step: int) -> bool:
        """Whether every node of the round said ``step`` whole."""
        if self.per_node:
            n = self._call("count a whole step", lambda: self.store.count(whole_key(step) + "/"))
            return isinstance(n, int) and n >= self.nodes
        raw = self._call("read a whole-step counter", lambda: self.store.try_get(whole_key(step)))
        if raw is _FAILED:
            return False
        try:
            return read_count(raw) >= self.nodes
        except BadValue as e:
            self._warn("bad count", f"{e}; the older replicas it guards are kept")
            return False

    def close(self) -> None:
        self._call("close", self.store.close)

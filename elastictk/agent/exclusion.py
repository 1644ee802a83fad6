"""Bad hosts: when a node is excluded from the job for a cooldown, and the record that says so.

A host whose workers keep failing spends the whole job's restart budget one failure at a time;
a host that drags every step (a straggler) or fails its health check slows or stops everyone.
The job takes such a node out for a while (``--exclude-after R/T``, ``--exclude-cooldown S``,
``--straggler-action exclude``) and goes on without it: at a smaller size (>= MIN) or with a
spare in its place. This module holds the pure parts, the agent side is
:mod:`elastictk.agent.excluded`:

- :class:`FailureWindow`: R failures of this node's workers within any T seconds (a sliding
  window on one monotonic clock, as Erlang/OTP's restart intensity).
- :class:`Cooldown`: how long the excluded node stays out.
- :class:`Exclusion`: the record, ``exclude/<node_id>`` in the round's store, sealed with the
  job's token (:mod:`elastictk.rendezvous.sealed`): a forged one reads as absent and excludes
  nobody.

What "until" means across hosts: the record carries the cooldown as a *duration*
(``cooldown_s``), never a point in time. Monotonic clocks of two hosts share no origin and
wall clocks can be off by any amount (a host 30 s behind would rejoin 30 s late, one ahead at
once), so only the excluded agent measures the cooldown, on its own monotonic clock, from the
moment it acts on the record. The others need no clock for it: they simply do not see the node
arrive. The cooldown therefore starts when the excluded node stops its workers, which is at
most one straggler interval after the leader's decision (the node reads its record once per
interval) and at once for its own failures or health check.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

REASONS = ("failures", "straggler", "health_check")
MAX_COOLDOWN = 7 * 86400.0  # a week: a record asking for more is clamped (records size nothing beyond it)
MAX_DETAIL = 300  # characters of the why kept in a record


def key(node_id: str) -> str:
    """The node's exclusion record, in the round's store (``rdzv/<job>/r/<n>/job/``): the MAC
    binds the round, so a record of an old round cannot be replayed into a later one."""
    return f"exclude/{node_id}"


def parse_after(text: str) -> tuple[int, float]:
    """``R/T`` as (R, T); ValueError naming the problem for anything else (the CLI words it)."""
    failures, slash, period = text.strip().partition("/")
    if not slash:
        raise ValueError(f"{text!r}: write R/T, e.g. 3/60 for 3 failures within 60 seconds")
    try:
        r = int(failures.strip())
    except ValueError:
        raise ValueError(f"{text!r}: R must be a whole number of failures >= 1, e.g. 3/60") from None
    try:
        t = float(period.strip())
    except ValueError:
        raise ValueError(f"{text!r}: T must be a number of seconds, e.g. 3/60") from None
    check_after(r, t)
    return r, t


def check_after(r: int, t: float) -> None:
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= 1_000_000:
        raise ValueError(f"R={r!r}: need a whole number of failures from 1 to 1000000, e.g. 3/60")
    if not (isinstance(t, (int, float)) and math.isfinite(t) and 0 < t <= 86400 * 30):
        raise ValueError(f"T={t!r}: need seconds more than 0 and at most 2592000 (30 days), e.g. 3/60")


def check_cooldown(seconds: float) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            math.isfinite(seconds) and 0 < seconds <= MAX_COOLDOWN):
        raise ValueError(f"{seconds!r}: need seconds more than 0 and at most {MAX_COOLDOWN:g} (a week), e.g. 300")


@dataclass(frozen=True)
class ExclusionSettings:
    """``--exclude-after R/T`` (None: failures never exclude), ``--exclude-cooldown S``, and
    whether stragglers and failed health checks exclude; validated on creation."""

    after: tuple[int, float] | None = None
    cooldown: float = 300.0
    stragglers: bool = False  # --straggler-action exclude

    def __post_init__(self) -> None:
        if self.after is not None:
            check_after(*self.after)
        check_cooldown(self.cooldown)

    @property
    def on(self) -> bool:
        return self.after is not None or self.stragglers


class FailureWindow:
    """Failures of this node's workers in a sliding window: :meth:`add` says whether the
    failure just added is the R-th within T seconds (first and last at most T apart).

    Times are one monotonic clock's; a time before the last one added is refused (ValueError):
    a window fed by two clocks would count wrongly, silently.
    """

    def __init__(self, failures: int, seconds: float) -> None:
        check_after(failures, seconds)
        self.failures, self.seconds = failures, float(seconds)
        self._times: deque[float] = deque()

    def add(self, at: float) -> bool:
        if self._times and at < self._times[-1]:
            raise ValueError(f"failure at {at!r} is before the last one ({self._times[-1]!r}): "
                             "the window takes one monotonic clock")
        self._times.append(at)
        self._drop(at)
        return len(self._times) >= self.failures

    def count(self, now: float) -> int:
        """Failures within the T seconds up to ``now``."""
        return sum(1 for t in self._times if now - t <= self.seconds)

    def span(self) -> float:
        """Seconds from the oldest failure kept to the newest."""
        return self._times[-1] - self._times[0] if self._times else 0.0

    def reset(self) -> None:
        """Start afresh (after an exclusion: the node's slate is clean when it rejoins)."""
        self._times.clear()

    def _drop(self, now: float) -> None:
        while self._times and now - self._times[0] > self.seconds:
            self._times.popleft()


@dataclass(frozen=True)
class Cooldown:
    """``seconds`` out from ``start`` (the excluded agent's own monotonic clock)."""

    start: float
    seconds: float

    @property
    def until(self) -> float:
        return self.start + self.seconds

    def left(self, now: float) -> float:
        return max(0.0, self.until - now)

    def over(self, now: float) -> bool:
        return now >= self.until


@dataclass(frozen=True)
class Exclusion:
    """One node out of the job for ``cooldown_s`` seconds: why (``reason``, one of
    :data:`REASONS`, and ``detail``, the why in words) and who decided (``by``)."""

    node_id: str
    reason: str
    detail: str
    cooldown_s: float
    by: str

    def to_json(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "reason": self.reason, "detail": self.detail[:MAX_DETAIL],
                "cooldown_s": self.cooldown_s, "by": self.by}

    @classmethod
    def from_json(cls, node_id: str, body: dict[str, Any] | None) -> "Exclusion | None":
        """The record read for ``node_id`` (already verified); None when absent, for another
        node, or malformed. A cooldown beyond :data:`MAX_COOLDOWN` is clamped to it."""
        if body is None or body.get("node_id") != node_id or body.get("reason") not in REASONS:
            return None
        cooldown, detail, by = body.get("cooldown_s"), body.get("detail"), body.get("by")
        if (isinstance(cooldown, bool) or not isinstance(cooldown, (int, float)) or not math.isfinite(cooldown)
                or cooldown <= 0 or not isinstance(detail, str) or not isinstance(by, str)):
            return None
        return cls(node_id, str(body["reason"]), detail[:MAX_DETAIL], min(float(cooldown), MAX_COOLDOWN), by)

    def line(self) -> str:
        """The one log line the excluded agent writes."""
        return (f"node {self.node_id} excluded for {self.cooldown_s:g}s: {self.detail}; its workers are "
                f"stopped and it rejoins after the cooldown")


def failures_detail(window: FailureWindow) -> str:
    return (f"its workers failed {window.failures} times in {window.span():.1f}s "
            f"(--exclude-after {window.failures}/{window.seconds:g})")


def rejoin_id(base: str, times: int) -> str:
    """The node id an excluded node rejoins under: a node once seen leaving is never counted
    alive again under its old id (``lost/<id>`` notes are permanent), so each return is a
    new incarnation, named after the first."""
    return f"{base}-rejoin{times}"


__all__ = ["Cooldown", "Exclusion", "ExclusionSettings", "FailureWindow", "MAX_COOLDOWN", "REASONS",
           "check_after", "check_cooldown", "failures_detail", "key", "parse_after", "rejoin_id"]

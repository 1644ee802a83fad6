"""The few knobs a fault plan is generated from, validated, and kept in the plan for replay.

Exactly one window says how faults are triggered: ``seconds=(lo, hi)`` (time faults, injected
from outside) or ``steps=(lo, hi)`` (step faults, injected inside the worker). Plans are one or
the other so that the attempt each step fault fires in is known in advance (a time fault could
spend a restart before or after a given step, depending on the machine's speed).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

from .kinds import HANGS, KINDS, STEP, TIME, FaultKindError, PlanError, known, parse_kind

DEFAULT_STEP_KINDS = ("sigkill", "sigterm", "sigsegv", "exception", "exit:1")
DEFAULT_TIME_KINDS = ("sigkill", "sigterm", "sigsegv")


# What a restarted agent takes to start and join its job again before a kill can find it running.
REJOIN_MARGIN_S = 10.0


@dataclass(frozen=True)
class Knobs:
    """``count`` faults among ``world_size`` ranks on ``nodes`` nodes (ranks are laid out node by
    node, ``world_size // nodes`` each), never touching the ranks in ``never``; at least
    ``min_gap_s`` seconds or ``min_gap_steps`` steps apart. ``kinds`` may name a parametrized
    kind bare (``slow``, ``exit``, ``store-outage``): its parameter is then drawn, seconds from
    ``slow_s``/``outage_s``. ``watchdog_s`` is the job's hang watchdog (collective timeout);
    hang kinds need one, or nothing would ever end the hang. ``rejoin_s`` (time faults on several
    nodes): a killed node's agent is started again that long after the kill, so a later kill may
    aim at it once it is back (:data:`REJOIN_MARGIN_S` after the restart, for its start and join);
    None: a killed node stays down for the rest of the plan."""

    count: int
    world_size: int
    seconds: Optional[tuple[float, float]] = None
    steps: Optional[tuple[int, int]] = None
    kinds: Optional[tuple[str, ...]] = None
    nodes: int = 1
    never: tuple[int, ...] = ()
    spare_nodes: tuple[int, ...] = ()  # nodes a node-only kind (kill-agent) never hits
    min_gap_s: float = 0.0
    min_gap_steps: int = 1
    slow_s: tuple[float, float] = (0.5, 3.0)
    outage_s: tuple[float, float] = (1.0, 5.0)
    watchdog_s: Optional[float] = None
    rejoin_s: Optional[float] = None

    def __post_init__(self) -> None:
        _int(self.count, "count", 0)
        _int(self.world_size, "world_size", 1)
        _int(self.nodes, "nodes", 1)
        _int(self.min_gap_steps, "min_gap_steps", 0)
        if self.world_size % self.nodes:
            raise PlanError(f"world_size {self.world_size} is not a multiple of nodes "
                            f"{self.nodes}; every node runs the same number of workers")
        if (self.seconds is None) == (self.steps is None):
            raise PlanError("give exactly one window: seconds=(lo, hi) for time faults or "
                            "steps=(lo, hi) for step faults")
        if self.seconds is not None:
            lo, hi = _pair(self.seconds, "seconds", float)
            if not 0 <= lo < hi <= 1e9:
                raise PlanError(f"seconds window {self.seconds!r} must satisfy 0 <= lo < hi")
            object.__setattr__(self, "seconds", (lo, hi))
        if self.steps is not None:
            lo_i, hi_i = _pair(self.steps, "steps", int)
            if not 0 <= lo_i < hi_i:
                raise PlanError(f"steps window {self.steps!r} must satisfy 0 <= lo < hi")
            object.__setattr__(self, "steps", (int(lo_i), int(hi_i)))
        if self.rejoin_s is not None and (isinstance(self.rejoin_s, bool) or not isinstance(
                self.rejoin_s, (int, float)) or not 0 <= self.rejoin_s <= 1e6):
            raise PlanError(f"rejoin_s {self.rejoin_s!r} must be a number of seconds >= 0")
        gap = self.min_gap_s
        if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0 <= gap <= 1e9:
            raise PlanError(f"min_gap_s {gap!r} must be a number of seconds >= 0")
        for name in ("slow_s", "outage_s"):
            lo, hi = _pair(getattr(self, name), name, float)
            if not 0 < lo <= hi <= 1e6:
                raise PlanError(f"{name} {getattr(self, name)!r} must satisfy 0 < lo <= hi")
            object.__setattr__(self, name, (lo, hi))
        if self.watchdog_s is not None and (isinstance(self.watchdog_s, bool) or not isinstance(
                self.watchdog_s, (int, float)) or not 0 < self.watchdog_s <= 1e9):
            raise PlanError(f"watchdog_s {self.watchdog_s!r} must be a number of seconds > 0 "
                            "(the job's --collective-timeout), or None")
        never = self.never
        if isinstance(never, (str, bytes)) or not hasattr(never, "__iter__"):
            raise PlanError(f"never {never!r} must be a list of ranks")
        never_t = tuple(sorted({_int(r, "never", 0) for r in never}))
        bad = [r for r in never_t if r >= self.world_size]
        if bad:
            raise PlanError(f"never names rank {bad[0]}, but world_size is {self.world_size}; "
                            f"ranks are 0..{self.world_size - 1}")
        object.__setattr__(self, "never", never_t)
        spare = self.spare_nodes
        if isinstance(spare, (str, bytes)) or not hasattr(spare, "__iter__"):
            raise PlanError(f"spare_nodes {spare!r} must be a list of node indexes")
        spare_t = tuple(sorted({_int(n, "spare_nodes", 0) for n in spare}))
        if any(n >= self.nodes for n in spare_t):
            raise PlanError(f"spare_nodes {list(spare_t)} names a node >= nodes {self.nodes}; "
                            f"nodes are 0..{self.nodes - 1}")
        object.__setattr__(self, "spare_nodes", spare_t)
        kinds = self.kinds if self.kinds is not None else self.default_kinds()
        if isinstance(kinds, str) or not kinds:
            raise PlanError(f"kinds {kinds!r} must be a non-empty list, e.g. ['sigkill', "
                            "'slow:1']")
        kinds_t = tuple(kinds)
        object.__setattr__(self, "kinds", kinds_t)
        trigger = self.trigger
        for spec in kinds_t:
            name = _kind_name(spec)
            if trigger not in KINDS[name].triggers:
                other = "steps=(lo, hi)" if trigger == TIME else "seconds=(lo, hi)"
                raise PlanError(f"kind {spec!r} cannot be triggered by {trigger}: it needs "
                                f"{other}; drop it from kinds or change the window")
            if name in HANGS and self.watchdog_s is None:
                raise PlanError(f"kind {spec!r} needs watchdog_s (the job's collective timeout): "
                                "without a watchdog nothing ends the hang (elastictk-run's default "
                                "--hang-detection learned is one)")
            if name != "slow" or self.watchdog_s is None:
                continue
            given = _given_seconds(spec)
            if given is not None:  # slow:<s> written out: used as given, whatever slow_s says
                if given >= self.watchdog_s:
                    raise PlanError(f"kind {spec!r}: a {given:g}s straggler is not shorter than "
                                    f"watchdog_s {self.watchdog_s:g}s, so it is caught as a hang; "
                                    "give fewer seconds or a longer --collective-timeout")
            elif self.slow_s[1] >= self.watchdog_s:
                raise PlanError(f"slow_s upper bound {self.slow_s[1]:g}s must stay below "
                                f"watchdog_s {self.watchdog_s:g}s, or the straggler is caught as "
                                "a hang")

    @property
    def trigger(self) -> str:
        return STEP if self.steps is not None else TIME

    def default_kinds(self) -> tuple[str, ...]:
        return DEFAULT_STEP_KINDS if self.steps is not None else DEFAULT_TIME_KINDS

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in list(d.items()):
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_json(cls, d: Any, where: str = "knobs") -> Knobs:
        """Parse knobs from JSON; unknown or bad fields raise :class:`PlanError` naming them."""
        if not isinstance(d, Mapping):
            raise PlanError(f"{where}: expected a JSON object of knobs, got {type(d).__name__}")
        fields = list(cls.__dataclass_fields__)
        for key in d:
            if key not in fields:
                raise PlanError(f"{where}: unknown field {key!r}; expected one of "
                                f"{', '.join(fields)}")
        args: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()}
        try:
            return cls(**args)
        except PlanError as e:
            raise PlanError(f"{where}: {e}") from None
        except TypeError as e:  # a required knob missing
            raise PlanError(f"{where}: {e}; the required knobs are count, world_size") from None


def _kind_name(spec: object) -> str:
    """A kind as written in knobs: a full kind (``slow:2``) or a bare parametrized name."""
    if isinstance(spec, str) and spec.strip() in KINDS:
        return spec.strip()
    try:
        return parse_kind(spec)[0]
    except FaultKindError as e:
        raise PlanError(f"kinds: {e}") from None


def _given_seconds(spec: object) -> Optional[float]:
    """The seconds of a ``slow:<s>`` written out in the knobs; None for a bare ``slow``."""
    if isinstance(spec, str) and spec.strip() in KINDS:
        return None
    return float(parse_kind(spec)[1] or 0)


def _int(v: object, name: str, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise PlanError(f"{name} {v!r} must be an integer >= {low}")
    return v


def _pair(v: object, name: str, typ: type) -> tuple[Any, Any]:
    ok = isinstance(v, (tuple, list)) and len(v) == 2 and all(
        not isinstance(x, bool) and isinstance(x, (int,) if typ is int else (int, float))
        and (typ is int or math.isfinite(x)) for x in v)
    if not ok:
        raise PlanError(f"{name} {v!r} must be a pair ({'integers' if typ is int else 'numbers'})"
                        " [lo, hi]")
    return typ(v[0]), typ(v[1])  # type: ignore[index]


__all__ = ["Knobs", "PlanError", "DEFAULT_STEP_KINDS", "DEFAULT_TIME_KINDS", "known"]

"""Restart policy: given what happened, should the agent restart, re-rendezvous or give up?

Pure on purpose. No clock is read here: each event carries its time (monotonic on one host, or
any clock the caller shares across hosts), and all memory lives in a ``PolicyState`` that
serializes to JSON, so a job-wide budget can sit in a store and be updated by compare-and-set.

Four independent limits compose into one ``RestartPolicy``:

* ``MaxRestarts(n)`` -- torchrun's budget. A worker failure spends one restart; a membership
  change (a node joining or leaving) spends none. With ``n`` restarts the (n+1)-th failure gives
  up. The count of failures spent so far is what workers see as ``TORCHELASTIC_RESTART_COUNT``
  (torch: ``max_restarts - remaining_restarts``), so it is unchanged by membership changes.
* ``RestartIntensity(R, T)`` -- Erlang/OTP's supervisor intensity: give up when more than ``R``
  failures fall within a closed window of ``T`` seconds (a crash loop), however large the budget.
* ``CrashLoop(k)`` -- ``k`` restarts in a row after each of which no rank completed a step
  end the job, however much budget is left: a script that cannot get going (a bad import, a
  missing file, a wrong address) fails the same way each time, and restarting it ``n`` times
  only delays the error. An attempt in which some rank completed a step starts the count over.
* ``Backoff`` -- how long to wait before a restart after a failure: exponential, capped,
  with jitter from a seeded hash so two runs with one seed wait the same, and agents with
  different seeds do not stampede the store together.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Optional

STATE_SCHEMA = "elastictk.restart-policy/1"


# ---------------------------------------------------------------- events and decisions
@dataclass(frozen=True)
class Failure:
    """A worker (or the group) failed at time ``t``. ``cause`` is a noun phrase for messages,
    e.g. ``FailureReport.root_cause.cause()`` -> ``rank 1's SIGSEGV (signal 11)``."""

    t: float
    cause: str = ""
    # Did some rank complete a step in the attempt that failed? False: a start-up failure;
    # None: not known (no steps block, or an in-place recovery): neither counts nor resets.
    progressed: Optional[bool] = None


@dataclass(frozen=True)
class MembershipChange:
    """Nodes joined or left at time ``t``; the group restarts without spending budget."""

    t: float
    cause: str = ""


Event = Failure | MembershipChange


@dataclass(frozen=True)
class Restart:
    """After a failure: stop the group, wait ``delay_s``, start a new attempt (through a new
    rendezvous round where there is one, as torchrun does); the workers get
    ``TORCHELASTIC_RESTART_COUNT=restart_count``."""

    delay_s: float
    restart_count: int


@dataclass(frozen=True)
class Rerendezvous:
    """Join a new rendezvous round for a membership change; the restart count is unchanged."""

    restart_count: int
    delay_s: float = 0.0


@dataclass(frozen=True)
class GiveUp:
    """Stop for good. ``reason`` is one line naming the limit that was hit and the fix."""

    reason: str


Decision = Restart | Rerendezvous | GiveUp


# ---------------------------------------------------------------- state
@dataclass(frozen=True)
class PolicyState:
    """Everything a policy remembers; JSON round-trips exactly (``to_json``/``from_json``)."""

    failures: int = 0  # failures spent from the budget == next TORCHELASTIC_RESTART_COUNT
    failure_times: tuple[float, ...] = ()  # only those still inside the intensity window
    backoff_step: int = 0  # restarts after failures since the backoff last reset
    last_start: Optional[float] = None  # when the current attempt started (for backoff reset)
    last_t: Optional[float] = None  # newest event time seen (a clock stepping back is clamped)
    gave_up: Optional[str] = None
    stalled: int = 0  # restarts in a row after which no rank completed a step (CrashLoop)
    stall_first: Optional[str] = None  # the cause of the first failure of that run

    @property
    def restart_count(self) -> int:
        return self.failures

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": STATE_SCHEMA, "failures": self.failures,
            "failure_times": list(self.failure_times), "backoff_step": self.backoff_step,
            "last_start": self.last_start, "last_t": self.last_t, "gave_up": self.gave_up,
            "stalled": self.stalled, "stall_first": self.stall_first,
        }

    @classmethod
    def from_json(cls, d: Any) -> PolicyState:
        """Parse stored state; anything else raises ``ValueError`` with one line naming it."""
        if not isinstance(d, dict) or d.get("schema") != STATE_SCHEMA:
            raise ValueError(f"restart policy state: expected a JSON object with schema "
                             f"{STATE_SCHEMA!r}; the store holds something else")

        def count(key: str) -> int:
            v = d.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"restart policy state: {key!r} must be an int >= 0, got {v!r}")
            return v

        def time_or_none(key: str) -> Optional[float]:
            v = d.get(key)
            if v is None:
                return None
            return _finite(v, f"restart policy state: {key!r}")

        times = d.get("failure_times", [])
        if not isinstance(times, list):
            raise ValueError(f"restart policy state: 'failure_times' must be a list, got {times!r}")
        text: dict[str, Optional[str]] = {}
        for key in ("gave_up", "stall_first"):
            v = d.get(key)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"restart policy state: {key!r} must be text, got {v!r}")
            text[key] = v
        return cls(
            failures=count("failures"),
            failure_times=tuple(_finite(t, "restart policy state: failure time") for t in times),
            backoff_step=count("backoff_step"), last_start=time_or_none("last_start"),
            last_t=time_or_none("last_t"), gave_up=text["gave_up"],
            stalled=count("stalled"), stall_first=text["stall_first"],
        )


def _finite(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{what} must be a finite number, got {v!r}")
    return float(v)


def _fix(cause: str) -> str:
    return f"fix {cause}" if cause else "fix the failing worker (see the failure report)"


# ---------------------------------------------------------------- the three limits
@dataclass(frozen=True)
class MaxRestarts:
    """torchrun's ``--max-restarts``: at most ``n`` restarts caused by failures."""

    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 0:
            raise ValueError(f"--max-restarts must be a whole number >= 0, got {self.n!r}")

    def check(self, failures: int, cause: str = "") -> Optional[str]:
        """The give-up line once ``failures`` (including the new one) exceed the budget."""
        if failures <= self.n:
            return None
        return (f"restart budget spent: {failures} failures > --max-restarts={self.n}; "
                f"raise --max-restarts or {_fix(cause)}")


@dataclass(frozen=True)
class RestartIntensity:
    """Erlang/OTP intensity: more than ``max_restarts`` failures within ``period`` seconds is a
    crash loop, not bad luck. The window is closed, ``[t - period, t]``, as in OTP."""

    max_restarts: int
    period: float

    def __post_init__(self) -> None:
        r = self.max_restarts
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"restart intensity: max_restarts must be a whole number >= 0, got {r!r}")
        p = self.period
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p < math.inf):
            raise ValueError(f"restart intensity: period must be seconds > 0, got {p!r}")

    def window(self, times: Iterable[float], now: float) -> tuple[float, ...]:
        """The failure times still inside the window that ends at ``now``."""
        return tuple(x for x in times if now - self.period <= x <= now)

    def check(self, in_window: int, cause: str = "") -> Optional[str]:
        if in_window <= self.max_restarts:
            return None
        return (f"restarting too often: {in_window} failures within {self.period:g}s > "
                f"{self.max_restarts} allowed (restart intensity {self.max_restarts} per "
                f"{self.period:g}s); raise the intensity limit or {_fix(cause)}")


@dataclass(frozen=True)
class CrashLoop:
    """``--max-no-progress-restarts k``: the job ends after ``k`` restarts in a row after each of
    which no rank completed a step (the first attempt is no restart: its failure starts the run
    but is not counted). An attempt in which some rank completed a step starts the count over;
    a failure whose progress is not known (``None``) leaves the count as it is."""

    k: int

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"--max-no-progress-restarts must be a whole number >= 1 (0 turns it "
                             f"off), got {self.k!r}")

    @staticmethod
    def count(stalled: int, first: Optional[str], *, restarted: bool, progressed: Optional[bool],
              cause: str) -> tuple[int, Optional[str]]:
        """The new (count, first failure's cause) after a failure; ``restarted``: the attempt
        that failed followed a restart (some earlier failure was restarted from)."""
        if progressed is None:
            return stalled, first
        if progressed:
            return 0, None
        return stalled + (1 if restarted else 0), first if first is not None else cause

    def check(self, stalled: int, first: Optional[str]) -> Optional[str]:
        """The give-up line once ``stalled`` reaches ``k``."""
        if stalled < self.k:
            return None
        return (f"crash loop: {stalled} restart{'' if stalled == 1 else 's'} without a completed step; first failure: "
                f"{first or 'unknown'}; fix it, or raise --max-no-progress-restarts")


@dataclass(frozen=True)
class Backoff:
    """Delay before the ``step``-th consecutive restart after a failure.

    ``initial * factor**(step-1)``, each term stretched by up to ``jitter`` (a fraction, from a
    hash of ``(seed, step)``), capped at ``max``; the running maximum makes the sequence
    non-decreasing even with jitter. ``reset_after``: a failure that comes this many seconds
    after the attempt started counts as new trouble, and the backoff starts over.
    """

    initial: float = 1.0
    factor: float = 2.0
    max: float = 60.0
    jitter: float = 0.0
    seed: int | str = 0
    reset_after: Optional[float] = None

    def __post_init__(self) -> None:
        for name, lo in (("initial", 0.0), ("factor", 1.0), ("max", 0.0), ("jitter", 0.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
                raise ValueError(f"backoff: {name} must be a finite number >= {lo:g}, got {v!r}")
        if self.max < self.initial:
            raise ValueError(f"backoff: max ({self.max:g}s) must be >= initial ({self.initial:g}s)")
        if self.jitter > 1:
            raise ValueError(f"backoff: jitter is a fraction in [0, 1], got {self.jitter!r}")
        ra = self.reset_after
        if ra is not None and (isinstance(ra, bool) or not isinstance(ra, (int, float)) or not (0 < ra < math.inf)):
            raise ValueError(f"backoff: reset_after must be seconds > 0 or None, got {ra!r}")

    def _unit(self, step: int) -> float:
        digest = hashlib.blake2b(f"{self.seed!r}/{step}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2.0**64

    def delay(self, step: int) -> float:
        """Seconds to wait before restart number ``step`` (1-based); 0 for ``step < 1``."""
        if step < 1 or self.initial == 0:
            return 0.0
        if self.jitter == 0 and self.factor == 1:
            return float(self.initial)
        best, base = 0.0, float(self.initial)
        for i in range(1, step + 1):  # reaches max in log(max/initial) steps unless factor is 1
            if i > 1:
                base = min(self.max, base * self.factor)
            stretched = base * (1.0 + self.jitter * self._unit(i)) if self.jitter else base
            best = max(best, min(self.max, stretched))
            if best >= self.max:
                return float(self.max)
        return best


# ---------------------------------------------------------------- the composed policy
@dataclass(frozen=True)
class RestartPolicy:
    """The limits together. ``max_restarts=None`` means no budget (intensity alone, as OTP);
    ``intensity`` may be given as ``(R, T)``; ``backoff=None`` restarts at once (as torchrun)."""

    max_restarts: MaxRestarts | int | None = 3
    intensity: RestartIntensity | tuple[int, float] | None = None
    backoff: Optional[Backoff] = field(default=None)
    crash_loop: CrashLoop | int | None = None  # --max-no-progress-restarts; None (or 0): off

    def __post_init__(self) -> None:
        if self.crash_loop == 0:
            object.__setattr__(self, "crash_loop", None)
        elif self.crash_loop is not None and not isinstance(self.crash_loop, CrashLoop):
            object.__setattr__(self, "crash_loop", CrashLoop(self.crash_loop))
        if self.max_restarts is not None and not isinstance(self.max_restarts, MaxRestarts):
            object.__setattr__(self, "max_restarts", MaxRestarts(self.max_restarts))
        if self.intensity is not None and not isinstance(self.intensity, RestartIntensity):
            try:
                r, t = self.intensity
            except (TypeError, ValueError):
                raise ValueError(f"restart intensity must be (max_restarts, period_s), "
                                 f"got {self.intensity!r}") from None
            object.__setattr__(self, "intensity", RestartIntensity(r, t))
        if self.backoff is not None and not isinstance(self.backoff, Backoff):
            raise ValueError(f"backoff must be a Backoff, got {type(self.backoff).__name__}")

    def initial_state(self) -> PolicyState:
        return PolicyState()

    def describe(self) -> str:
        """One line for logs: ``max 3 restarts; at most 5 per 60s; backoff 1s x2 up to 60s``."""
        parts = []
        mr = self.max_restarts
        parts.append(f"max {mr.n} restarts" if isinstance(mr, MaxRestarts) else "no restart budget")
        if isinstance(self.intensity, RestartIntensity):
            parts.append(f"at most {self.intensity.max_restarts} per {self.intensity.period:g}s")
        if isinstance(self.crash_loop, CrashLoop):
            parts.append(f"at most {self.crash_loop.k} restarts in a row without a step")
        b = self.backoff
        if b is None:
            parts.append("restart at once")
        else:
            jit = f", jitter {b.jitter:g}" if b.jitter else ""
            parts.append(f"backoff {b.initial:g}s x{b.factor:g} up to {b.max:g}s{jit}")
        return "; ".join(parts)

    def decide(self, state: PolicyState, event: Event) -> tuple[PolicyState, Decision]:
        """The next state and what to do about ``event``. Pure; GiveUp is final."""
        if state.gave_up is not None:
            return state, GiveUp(state.gave_up)
        t = _finite(event.t, "event time")
        if state.last_t is not None and t < state.last_t:
            t = state.last_t  # a clock that stepped back is treated as not having moved
        if isinstance(event, MembershipChange):
            return (replace(state, last_start=t, last_t=t),
                    Rerendezvous(restart_count=state.failures))
        if not isinstance(event, Failure):
            raise TypeError(f"unknown restart policy event {event!r}")
        return self._on_failure(state, t, event.cause, event.progressed)

    def _on_failure(self, state: PolicyState, t: float, cause: str,
                    progressed: Optional[bool] = None) -> tuple[PolicyState, Decision]:
        failures = state.failures + 1
        stalled, first = CrashLoop.count(state.stalled, state.stall_first, restarted=state.failures > 0,
                                         progressed=progressed, cause=cause)
        state = replace(state, stalled=stalled, stall_first=first)
        window: tuple[float, ...] = ()
        if isinstance(self.intensity, RestartIntensity):
            window = self.intensity.window(state.failure_times + (t,), t)
        reason = None
        if isinstance(self.crash_loop, CrashLoop):  # first: it says more than "budget spent"
            reason = self.crash_loop.check(stalled, first)
        if reason is None and isinstance(self.max_restarts, MaxRestarts):
            reason = self.max_restarts.check(failures, cause)
        if reason is None and isinstance(self.intensity, RestartIntensity):
            reason = self.intensity.check(len(window), cause)
        if reason is not None and self.crash_loop is None and stalled >= 1:
            reason += (f"; the last {stalled + 1} attempts all failed before any rank's first step "
                       "(a deterministic start-up error is retried like any failure, as torchrun "
                       "does): --max-no-progress-restarts 1 stops after one such restart")
        if reason is not None:
            return (replace(state, failures=failures, failure_times=window, last_t=t,
                            gave_up=reason), GiveUp(reason))
        step = state.backoff_step
        b = self.backoff
        if (b is not None and b.reset_after is not None and state.last_start is not None
                and t - state.last_start >= b.reset_after):
            step = 0
        step += 1
        delay = b.delay(step) if b is not None else 0.0
        new = replace(state, failures=failures, failure_times=window, backoff_step=step,
                      last_start=t + delay, last_t=t)
        return new, Restart(delay_s=delay, restart_count=failures)

    def run(self, events: Iterable[Event],
            state: Optional[PolicyState] = None) -> tuple[PolicyState, list[Decision]]:
        """Feed ``events`` in order (stopping at the first GiveUp); for replays and tests."""
        state = state if state is not None else self.initial_state()
        out: list[Decision] = []
        for ev in events:
            state, d = self.decide(state, ev)
            out.append(d)
            if isinstance(d, GiveUp):
                break
        return state, out

"""The fault kinds: their names and parameters, when and where each can be injected, and
whether each one spends a restart.

A kind is written ``name`` or ``name:<param>`` (``sigkill``, ``exit:3``, ``slow:2.5``,
``store-outage:5``). Parsing is one function so the plan file, the generator's knobs and a future
CLI all reject the same garbage with the same one-line message.

Triggers. ``step`` faults fire inside the worker when its training loop reaches a step
(``elastictk.faults.fault_point`` or the launcher's automatic mode); ``time`` faults fire from
outside, as signals to PIDs the agent reports, at an offset from the job's start. A kind that
can only happen inside the worker (an exception, an exit code, a hang inside a collective) needs a
step; one that only an outsider can do (killing the agent, stopping the store) needs a time.

Restarts (:func:`needs_restart`). Every crash spends one. A hang spends one only when a watchdog
catches it (the job's collective timeout, ``watchdog_s``): without one the job simply hangs,
so nothing is restarted. A straggler (``slow:<s>``) spends none, unless it is slower than the
watchdog, which then takes it for a hang. A store outage spends none: riding over a short outage
is what the elastic layer must do. Killing an agent spends one: the other nodes' workers fail in
their next collective with the lost ranks (if the survivors' agents notice the membership
change before any worker fails, none is spent; a single-node job simply ends).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

Param = int | float | None

STEP, TIME = "step", "time"
RANK, NODE, STORE = "rank", "node", "store"


@dataclass(frozen=True)
class KindInfo:
    """What one kind needs: its parameter (``None``, ``"code"`` or ``"seconds"``), the triggers
    and target kinds it accepts, and a noun phrase for messages."""

    name: str
    param: Optional[str]
    triggers: frozenset[str]
    targets: frozenset[str]
    what: str


_BOTH = frozenset({STEP, TIME})
_WORKER = frozenset({RANK, NODE})
KINDS: dict[str, KindInfo] = {k.name: k for k in (
    KindInfo("sigkill", None, _BOTH, _WORKER, "SIGKILL to the worker"),
    KindInfo("sigterm", None, _BOTH, _WORKER, "SIGTERM to the worker"),
    KindInfo("sigsegv", None, _BOTH, _WORKER, "a segmentation fault in the worker"),
    KindInfo("exception", None, frozenset({STEP}), _WORKER, "an exception raised in the worker"),
    KindInfo("exit", "code", frozenset({STEP}), _WORKER, "the worker exiting with a code"),
    KindInfo("hang", None, _BOTH, _WORKER, "the worker stopped (SIGSTOP)"),
    KindInfo("hang-in-collective", None, frozenset({STEP}), _WORKER,
             "the worker blocking inside all_reduce"),
    KindInfo("slow", "seconds", _BOTH, _WORKER, "a straggler pausing for a while"),
    KindInfo("kill-agent", None, frozenset({TIME}), frozenset({NODE}),
             "the node's agent SIGKILLed (node loss)"),
    KindInfo("store-outage", "seconds", frozenset({TIME}), frozenset({STORE}),
             "the store stopped for a while"),
)}
CRASHES = frozenset({"sigkill", "sigterm", "sigsegv", "exception", "exit"})
HANGS = frozenset({"hang", "hang-in-collective"})
MAX_SECONDS = 1e6  # a parameter beyond ~11 days is a typo, not a fault


class PlanError(ValueError):
    """A fault plan, a fault or the knobs are wrong; the message is one line naming the problem
    (and the file and field, where there is one) and the fix."""


class FaultKindError(PlanError):
    """A kind or target that does not parse."""


def known() -> str:
    """The kinds as users write them, for messages."""
    return ", ".join(f"{k.name}:<{k.param}>" if k.param else k.name for k in KINDS.values())


def parse_kind(text: object) -> tuple[str, Param]:
    """``"slow:2.5"`` -> ``("slow", 2.5)``; ``"exit:3"`` -> ``("exit", 3)``; ``"sigkill"`` ->
    ``("sigkill", None)``. Anything else raises :class:`FaultKindError` (one line)."""
    if not isinstance(text, str) or not text.strip():
        raise FaultKindError(f"fault kind {text!r} must be a non-empty string; one of {known()}")
    name, sep, raw = text.strip().partition(":")
    info = KINDS.get(name)
    if info is None:
        raise FaultKindError(f"unknown fault kind {name!r}; use one of {known()}")
    if info.param is None:
        if sep:
            raise FaultKindError(f"fault kind {name!r} takes no parameter; write {name!r}, "
                                 f"not {text.strip()!r}")
        return name, None
    if not sep or not raw.strip():
        example = "exit:1" if info.param == "code" else f"{name}:2.5"
        raise FaultKindError(f"fault kind {name!r} needs its {info.param}: write "
                             f"{name}:<{info.param}>, e.g. {example}")
    return name, check_param(name, raw.strip())


def check_param(name: str, raw: object) -> Param:
    """Validate (and convert from text) the parameter of kind ``name``."""
    info = KINDS[name]
    if info.param == "code":
        try:
            code = int(raw) if isinstance(raw, (str, int)) and not isinstance(raw, bool) else None
        except ValueError:
            code = None
        if code is None or not 1 <= code <= 255:
            raise FaultKindError(f"exit code {raw!r} must be an integer from 1 to 255 (exit:0 is "
                                 "a clean exit, not a fault), e.g. exit:1")
        return code
    if info.param == "seconds":
        try:
            s = float(raw) if isinstance(raw, (str, int, float)) and not isinstance(raw, bool) \
                else math.nan
        except ValueError:
            s = math.nan
        if not (0 < s <= MAX_SECONDS):
            raise FaultKindError(f"{name} seconds {raw!r} must be a number > 0 and <= "
                                 f"{MAX_SECONDS:g}, e.g. {name}:2.5")
        return s
    if raw is not None:
        raise FaultKindError(f"fault kind {name!r} takes no parameter")
    return None


def format_kind(name: str, param: Param) -> str:
    """The inverse of :func:`parse_kind` (``parse_kind(format_kind(n, p)) == (n, p)``)."""
    if param is None:
        return name
    if isinstance(param, float):
        return f"{name}:{int(param)}" if param.is_integer() and abs(param) < 2**53 \
            else f"{name}:{param!r}"
    return f"{name}:{param}"


def needs_restart(name: str, param: Param, watchdog_s: Optional[float]) -> bool:
    """Whether a fault of this kind spends one restart of the job's budget (see the module's
    docstring for why each answer is what it is)."""
    if name in CRASHES or name == "kill-agent":
        return True
    if name in HANGS:
        return watchdog_s is not None
    if name == "slow":
        return watchdog_s is not None and float(param or 0) >= watchdog_s
    return False  # store-outage

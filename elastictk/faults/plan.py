"""A fault plan: plain data saying which fault hits which part of the job, and when.

::

    {"schema": "elastictk.fault-plan/1", "watchdog_s": 30,
     "faults": [{"at_step": 20, "target": "rank:1", "kind": "sigsegv", "attempt": 0},
                {"at_s": 12.5, "target": "node:0", "kind": "kill-agent"}]}

A fault fires once per job, not once per attempt. Step faults say so without shared state:
each carries the attempt (``TORCHELASTIC_RESTART_COUNT``) it fires in. Left out, it is
assigned in step order, counting the restarts the earlier step faults spend, which is exactly
the attempt the job is in when it reaches that step; a time fault spending a restart before a
step fault shifts that count, so a plan mixing both should write ``attempt`` by hand. Time
faults fire once, from outside, at their offset from the job's start.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

from .kinds import KINDS, STEP, TIME, Param, PlanError, check_param, format_kind, known, \
    needs_restart, parse_kind
from .knobs import Knobs
from .target import Target

SCHEMA = "elastictk.fault-plan/1"
_FAULT_FIELDS = ("at_s", "at_step", "target", "kind", "attempt")
_PLAN_FIELDS = ("schema", "faults", "watchdog_s", "seed", "knobs")


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` (with ``param``) hits ``target`` at ``at_s`` seconds after the job
    started, or when the target reaches step ``at_step`` in attempt ``attempt``."""

    kind: str
    target: Target
    at_s: Optional[float] = None
    at_step: Optional[int] = None
    param: Param = None
    attempt: Optional[int] = None  # step faults only; None: assigned by the plan

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PlanError(f"unknown fault kind {self.kind!r}; use one of {known()}")
        object.__setattr__(self, "param", check_param(self.kind, self.param))
        if not isinstance(self.target, Target):
            object.__setattr__(self, "target", Target.parse(self.target))
        info = KINDS[self.kind]
        if (self.at_s is None) == (self.at_step is None):
            raise PlanError(f"{self.describe()}: give exactly one of at_s (seconds after the "
                            "job started) or at_step")
        if self.at_s is not None:
            if isinstance(self.at_s, bool) or not isinstance(self.at_s, (int, float)) or \
                    not (math.isfinite(self.at_s) and 0 <= self.at_s <= 1e9):
                raise PlanError(f"{self.describe()}: at_s {self.at_s!r} must be a number of "
                                "seconds >= 0")
            object.__setattr__(self, "at_s", float(self.at_s))
            if self.attempt is not None:
                raise PlanError(f"{self.describe()}: attempt applies to step faults only; a time "
                                "fault fires once, at its time; remove attempt")
        if self.at_step is not None and (isinstance(self.at_step, bool) or not isinstance(
                self.at_step, int) or self.at_step < 0):
            raise PlanError(f"{self.describe()}: at_step {self.at_step!r} must be an integer >= 0")
        if self.attempt is not None and (isinstance(self.attempt, bool) or not isinstance(
                self.attempt, int) or self.attempt < 0):
            raise PlanError(f"{self.describe()}: attempt {self.attempt!r} must be an integer >= 0")
        if self.trigger not in info.triggers:
            fix = ("it happens inside the worker, so write at_step instead of at_s"
                   if self.trigger == TIME else
                   "it is done from outside the workers, so write at_s instead of at_step")
            raise PlanError(f"{self.describe()}: {self.spec} cannot fire at a {self.trigger}: "
                            f"{fix}")
        if self.target.kind not in info.targets:
            want = " or ".join(f"'{t}:<n>'" if t != "store" else "'store'" for t in
                               sorted(info.targets))
            raise PlanError(f"{self.describe()}: {self.spec} cannot target '{self.target}'; "
                            f"target {want}")

    @classmethod
    def of(cls, kind: str, target: str | Target, *, at_s: Optional[float] = None,
           at_step: Optional[int] = None, attempt: Optional[int] = None) -> Fault:
        """Build from the written forms: ``Fault.of("slow:2", "rank:1", at_step=30)``."""
        name, param = parse_kind(kind)
        return cls(name, Target.parse(target), at_s=at_s, at_step=at_step, param=param, attempt=attempt)

    @property
    def spec(self) -> str:
        """The kind as written: ``slow:2.5``."""
        return format_kind(self.kind, self.param)

    @property
    def trigger(self) -> str:
        return TIME if self.at_s is not None else STEP

    def describe(self) -> str:
        """``sigkill on rank:1 at step 30 (attempt 0)`` / ``kill-agent on node:0 at 12.5s``."""
        if self.at_s is not None:
            when = f"at {self.at_s:g}s" if isinstance(self.at_s, (int, float)) else \
                f"at {self.at_s!r}s"
        else:
            when = f"at step {self.at_step}" + (
                "" if self.attempt is None else f" (attempt {self.attempt})")
        return f"{format_kind(self.kind, self.param)} on {self.target} {when}"

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.spec, "target": str(self.target)}
        if self.at_s is not None:
            d["at_s"] = self.at_s
        else:
            d["at_step"] = self.at_step
            if self.attempt is not None:
                d["attempt"] = self.attempt
        return d

    @classmethod
    def from_json(cls, d: Any, where: str) -> Fault:
        if not isinstance(d, Mapping):
            raise PlanError(f"{where}: expected a JSON object, got {type(d).__name__}")
        for key in d:
            if key not in _FAULT_FIELDS:
                raise PlanError(f"{where}: unknown field {key!r}; expected "
                                f"{', '.join(_FAULT_FIELDS)}")
        for key in ("kind", "target"):
            if key not in d:
                raise PlanError(f"{where}: missing field {key!r}")
        try:
            return cls.of(d["kind"], d["target"], at_s=d.get("at_s"), at_step=d.get("at_step"),
                          attempt=d.get("attempt"))
        except PlanError as e:
            raise PlanError(f"{where}: {e}") from None


@dataclass(frozen=True)
class FaultPlan:
    """The faults of one chaos run, in the order written (the index names a fault in logs and
    reports). ``watchdog_s`` is the job's hang watchdog (collective timeout), which decides
    whether hangs and stragglers spend restarts; ``seed`` and ``knobs`` record how a generated
    plan was made. Step faults' attempts are resolved on construction."""

    faults: tuple[Fault, ...] = ()
    watchdog_s: Optional[float] = None
    seed: Optional[int] = None
    knobs: Optional[Knobs] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        faults = tuple(self.faults)
        for f in faults:
            if not isinstance(f, Fault):
                raise PlanError(f"a plan holds Fault objects, got {type(f).__name__}")
        w = self.watchdog_s
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, float))
                              or not (0 < w <= 1e9)):
            raise PlanError(f"watchdog_s {w!r} must be a number of seconds > 0 (the job's "
                            "collective timeout), or null")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise PlanError(f"seed {self.seed!r} must be an integer or null")
        object.__setattr__(self, "faults", self._assign_attempts(faults))

    def _assign_attempts(self, faults: tuple[Fault, ...]) -> tuple[Fault, ...]:
        out = list(faults)
        order = sorted((i for i, f in enumerate(faults) if f.at_step is not None),
                       key=lambda i: (faults[i].at_step, i))
        attempt = 0
        for i in order:
            f = faults[i]
            a = attempt if f.attempt is None else f.attempt
            out[i] = f if f.attempt == a else replace(f, attempt=a)
            attempt = max(attempt, a + 1 if self.needs_restart(f) else a)
        return tuple(out)

    # -- questions -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Fault]:
        return iter(self.faults)

    def __len__(self) -> int:
        return len(self.faults)

    def needs_restart(self, fault: Fault) -> bool:
        """Whether ``fault`` spends a restart of the job's budget (see ``kinds``)."""
        return needs_restart(fault.kind, fault.param, self.watchdog_s)

    def expected_restarts(self) -> int:
        """Restarts the plan spends when each fault lands in a different attempt (the spacing
        of a generated plan is for that: a fault arriving while the job is still restarting from
        the previous one is absorbed by that restart)."""
        return sum(1 for f in self.faults if self.needs_restart(f))

    def step_faults(self, rank: int, node: Optional[int], attempt: int) -> list[tuple[int, Fault]]:
        """(index, fault) of the step faults that hit this worker in this attempt, by step."""
        hits = [(i, f) for i, f in enumerate(self.faults) if f.at_step is not None
                and f.attempt == attempt and f.target.hits(rank, node)]
        return sorted(hits, key=lambda p: (p[1].at_step, p[0]))

    def time_faults(self) -> list[tuple[int, Fault]]:
        """(index, fault) of the time faults, by time."""
        return sorted(((i, f) for i, f in enumerate(self.faults) if f.at_s is not None),
                      key=lambda p: (p[1].at_s, p[0]))

    # -- JSON ----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"schema": SCHEMA, "watchdog_s": self.watchdog_s, "seed": self.seed,
                             "faults": [f.to_json() for f in self.faults]}
        if self.knobs is not None:
            d["knobs"] = self.knobs.to_json()
        return d

    @classmethod
    def from_json(cls, d: Any, source: str = "plan") -> FaultPlan:
        """Parse a plan; anything wrong raises :class:`PlanError` naming ``source`` and the
        field."""
        if not isinstance(d, Mapping):
            raise PlanError(f"{source}: expected a JSON object with \"schema\": {SCHEMA!r}")
        for key in d:
            if key not in _PLAN_FIELDS:
                raise PlanError(f"{source}: unknown field {key!r}; expected "
                                f"{', '.join(_PLAN_FIELDS)}")
        if d.get("schema") != SCHEMA:
            raise PlanError(f"{source}: schema {d.get('schema')!r} is not supported (this "
                            f"elastictk reads {SCHEMA!r}); set \"schema\": {SCHEMA!r} or "
                            "regenerate the plan")
        raw = d.get("faults")
        if not isinstance(raw, list):
            raise PlanError(f"{source}: field 'faults' must be a list of faults")
        faults = [Fault.from_json(f, f"{source}: fault #{i}") for i, f in enumerate(raw)]
        knobs = None
        if d.get("knobs") is not None:
            knobs = Knobs.from_json(d["knobs"], f"{source}: field 'knobs'")
        try:
            return cls(tuple(faults), watchdog_s=d.get("watchdog_s"), seed=d.get("seed"),
                       knobs=knobs)
        except PlanError as e:
            raise PlanError(f"{source}: {e}") from None

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan atomically (a worker reading it never sees half a file), through a
        fresh ``O_EXCL|O_NOFOLLOW`` temporary name renamed into place: a symlink planted at the
        plan's name, or at a predictable temporary name, is never followed."""
        from .._paths import write_file

        return write_file(path, self.dumps())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> FaultPlan:
        """Read a plan file; a missing, huge, non-UTF-8, nested or non-JSON file, or a bad
        field, raises one line naming it."""
        return cls.from_json(read_json(path, "the fault plan"), str(Path(path)))


#: A plan file larger than this is refused unread: a generated plan of a thousand faults is
#: about 100 KiB.
MAX_PLAN_BYTES = 16 << 20


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; write a finite number or null")


def read_json(path: str | os.PathLike[str], what: str, *, max_bytes: int = MAX_PLAN_BYTES,
              allow_nan: bool = False) -> Any:
    """The JSON document in file ``path``, or :class:`PlanError` with one line naming the file
    and the problem: unreadable, larger than ``max_bytes``, not UTF-8, not JSON, nested past
    the parser's depth, or holding ``NaN``/``Infinity`` (unless ``allow_nan``). A file is input
    from outside the process: nothing but ``PlanError`` leaves here."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise PlanError(f"{p}: cannot read {what}: {e.strerror or e}") from None
    if len(raw) > max_bytes:
        raise PlanError(f"{p}: {what} is larger than {max_bytes >> 20} MiB; pass the JSON file "
                        "elastictk wrote")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlanError(f"{p}: {what} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                        f"{e.start}); pass the JSON file elastictk wrote") from None
    try:
        return json.loads(text, parse_constant=None if allow_nan else _no_constant)
    except RecursionError:
        raise PlanError(f"{p}: {what} is nested too deeply to be JSON elastictk wrote") from None
    except ValueError as e:
        raise PlanError(f"{p}: not valid JSON ({_one_line(str(e))})") from None


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def plan_of(faults: Sequence[Fault], **kw: Any) -> FaultPlan:
    """A hand-written plan: ``plan_of([Fault.of("sigkill", "rank:1", at_step=5)], watchdog_s=30)``."""
    return FaultPlan(tuple(faults), **kw)

"""The in-worker injector: ``elastictk.faults.fault_point(step)`` performs the plan's step faults
for real, at the exact step, in the worker they target.

::

    for step in range(start, steps):
        elastictk.faults.fault_point(step)
        train_step(...)

Cost without a plan: one comparison. The plan (``ELASTICTK_FAULT_PLAN``) is read on the first
call only; the faults kept are those hitting this worker (``RANK``, or its node ``GROUP_RANK``)
in this attempt (``TORCHELASTIC_RESTART_COUNT``), and ``_next`` holds the first step due (or
infinity), so every later call is ``step < _next``.

A fault fires the first time ``fault_point`` sees a step at or past its own (a job resumed from a
checkpoint beyond it still gets it), at most once per process, and only in its attempt, which is
what makes it once per job. What each kind does, in the worker:

- ``sigkill`` / ``sigterm`` / ``hang``: the signal (SIGKILL, SIGTERM, SIGSTOP) sent to itself.
- ``sigsegv``: a real invalid read (``ctypes.string_at(0)``): the kernel's SIGSEGV.
- ``exception``: raises :class:`InjectedFault` from ``fault_point``; ``exit:<code>``:
  ``sys.exit(code)``. Both unwind through the user's code like the real thing.
- ``slow:<s>``: sleeps ``s`` seconds: the peers wait for it in their next collective.
- ``hang-in-collective``: the worker's next ``all_reduce`` never returns (see ``auto``).

Each fault is announced first: one line on stderr and, with ``ELASTICTK_FAULT_LOG``, one JSON
line appended to that file.

Where the step comes from, highest first: the script's own ``fault_point(step)``; then
``run_elastic``'s report of each step it runs (:func:`loop_step`, which also re-arms the plan
for the generation's restart count and rank: under in-place recovery a surviving worker lives
through several attempts); then the automatic count (``auto``: optimizer steps or all_reduce
calls). A source stands aside for good once a higher one reports. With ``ELASTICTK_FAULT_LOG``
each worker also writes a ``progress`` line when it sees its first step and when it exits (the
source and the last step), so a chaos run can say why a fault did not fire.
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from typing import Optional

from ..timer.marksink import mark as _progress_mark
from .collective import OP, block_in_collective, ensure_wrapped
from .env import ENV_LOG, ENV_PLAN
from .kinds import PlanError
from .plan import Fault, FaultPlan


class InjectedFault(RuntimeError):
    """The ``exception`` fault: raised by ``fault_point`` at the planned step."""


# Module state: the hot path reads _next only. -inf: the plan was not read yet.
_next: float = -math.inf
_due: list[tuple[int, Fault]] = []  # (plan index, fault), in step order
_who: dict[str, Optional[int]] = {}
_level = 0  # the highest step source seen: 0 none, then AUTO < LOOP < USER
AUTO, LOOP, USER = 1, 2, 3
SOURCES = {AUTO: "auto", LOOP: "loop", USER: "checkpoint"}  # record tags: "checkpoint" is fault_point
_last_step: Optional[int] = None  # the last step seen, from the source in force
_reported = False  # the first-step progress line was written
hang_armed: Optional[tuple[int, Fault]] = None  # read by the all_reduce wrapper
_plan: Optional[FaultPlan] = None
_fired: set[int] = set()  # plan indexes fired in this process (a re-arm never repeats one)
_lock = threading.RLock()


def fault_point(step: int) -> None:
    """Perform the faults planned for this worker at ``step`` (see the module's docstring).
    Named apart from ``elastictk.metrics.checkpoint()``, which says a checkpoint was saved."""
    global _last_step, _level
    _progress_mark()  # progress for the agent's hang judge (elastictk/metrics/marks.py)
    step = _step_number(step)
    if _level != USER:
        _take(USER, step)
    _last_step = step
    if step < _next:
        return
    _reached(step, "checkpoint")


def _step_number(step: object) -> int:
    """The step as an int (numpy and torch ints included); anything else is the caller's mistake,
    named here rather than as a comparison error deep in the plan."""
    import operator

    if isinstance(step, bool):
        raise TypeError(f"fault_point(step={step!r}): the step number, an int")
    try:
        return operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        text = repr(step)
        raise TypeError(f"fault_point(step={text[:40]}): the step number, an int (the step the "
                        "job is about to run or just ran)") from None


def auto_step(step: int) -> None:
    """The automatic count's step; ignored once a script or ``run_elastic`` reports steps."""
    global _last_step
    if _level > AUTO:
        return
    if not _level:
        _take(AUTO, step)
    _last_step = step
    if step >= _next:
        _reached(step, "auto")


def loop_step(step: int, *, rank: int, attempt: int) -> None:
    """``run_elastic``'s step, about to run as ``rank`` in attempt ``attempt`` (the restart count
    of its generation): re-arms when either changed; ignored once ``checkpoint`` is used."""
    global _last_step
    if _level > LOOP:
        return
    if _level < LOOP:
        _take(LOOP, step)
    if _next == -math.inf:
        load_from_env()
    if (_who.get("rank"), _who.get("attempt")) != (rank, attempt) and _plan is not None:
        arm(_plan, rank=rank, node=_who.get("node"), attempt=attempt)
    _last_step = step
    if step >= _next:
        _reached(step, "loop")


def _take(level: int, step: int) -> None:
    """A step source reports for the first time (or outranks the one before)."""
    global _level, _reported
    with _lock:
        _level = max(_level, level)
        first = not _reported
        _reported = True
    if first:
        if _next == -math.inf:
            load_from_env()
        _progress("first", step)
        import atexit

        atexit.register(lambda: _progress("exit", _last_step))


def arm(plan: FaultPlan, *, rank: int, node: Optional[int] = None, attempt: int = 0) -> int:
    """Keep the step faults of ``plan`` that hit this worker in this attempt; returns how many.

    ``checkpoint`` does this itself from the environment; call it to inject without a launcher.
    """
    global _next, _due, _who, _plan
    with _lock:
        _plan = plan
        _due = [p for p in plan.step_faults(rank, node, attempt) if p[0] not in _fired]
        _who = {"rank": rank, "node": node, "attempt": attempt}
        _next = _due[0][1].at_step if _due else math.inf  # type: ignore[assignment]
        if any(f.kind == "hang-in-collective" for _, f in _due):
            ensure_wrapped(on_hang=_hang_if_armed)
        return len(_due)


def _hang_if_armed() -> None:
    """Run by the all_reduce wrapper: a ``hang-in-collective`` that fired blocks right here."""
    if hang_armed is not None:
        block_in_collective(OP)


def pending() -> list[tuple[int, Fault]]:
    """(plan index, fault) of the faults still to fire in this process."""
    with _lock:
        return list(_due)


def load_from_env() -> int:
    """Arm from ``ELASTICTK_FAULT_PLAN``, ``RANK``, ``GROUP_RANK`` and
    ``TORCHELASTIC_RESTART_COUNT`` (once; later calls return what is pending)."""
    global _next
    with _lock:
        if _next != -math.inf:
            return len(_due)
        path = os.environ.get(ENV_PLAN)
        if not path:
            _next = math.inf
            return 0
        try:
            plan = FaultPlan.load(path)
            rank = _env_int("RANK", None)
            if rank is None:
                raise PlanError("RANK is not set: run the script under elastictk-run or torchrun")
            node = _env_int("GROUP_RANK", None)
            attempt = _env_int("TORCHELASTIC_RESTART_COUNT", 0) or 0
        except PlanError as e:
            print(f"elastictk.faults: no faults injected in this worker: {e}", file=sys.stderr)
            _next = math.inf
            return 0
        return arm(plan, rank=rank, node=node, attempt=attempt)


def _env_int(name: str, default: Optional[int]) -> Optional[int]:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise PlanError(f"{name}={raw!r} is not an integer") from None


def _reached(step: int, source: str) -> None:
    global _next
    if _next == -math.inf:
        load_from_env()
    with _lock:
        fire: list[tuple[int, Fault]] = []
        while _due and _due[0][1].at_step <= step:  # type: ignore[operator]
            fire.append(_due.pop(0))
            _fired.add(fire[-1][0])
        _next = _due[0][1].at_step if _due else math.inf  # type: ignore[assignment]
    for index, fault in fire:
        _perform(index, fault, step, source)


def _perform(index: int, fault: Fault, step: int, source: str) -> None:
    global hang_armed
    _announce(index, fault, step, source)
    kind = fault.kind
    me = os.getpid()
    if kind == "sigkill":
        os.kill(me, signal.SIGKILL)
    elif kind == "sigterm":
        os.kill(me, signal.SIGTERM)
    elif kind == "hang":
        os.kill(me, signal.SIGSTOP)
    elif kind == "sigsegv":
        import ctypes

        ctypes.string_at(0)  # a read of address 0: the kernel delivers SIGSEGV
    elif kind == "exception":
        raise InjectedFault(f"elastictk injected fault #{index}: {fault.describe()} "
                            f"(reached step {step})")
    elif kind == "exit":
        sys.exit(int(fault.param or 1))
    elif kind == "slow":
        time.sleep(float(fault.param or 0))  # the straggler itself: nothing to wait on
    elif kind == "hang-in-collective":
        hang_armed = (index, fault)


def _announce(index: int, fault: Fault, step: int, source: str) -> None:
    """One stderr line and one fault-log line, written before the fault can end the process."""
    rank = _who.get("rank")
    print(f"elastictk.faults: injecting fault #{index} ({fault.spec}) in rank {rank} at step "
          f"{step}, attempt {_who.get('attempt')}", file=sys.stderr, flush=True)
    _log({"fault": index, "kind": fault.spec, "target": str(fault.target), "rank": rank,
          "node": _who.get("node"), "attempt": _who.get("attempt"), "step": step,
          "planned_step": fault.at_step, "pid": os.getpid(), "source": source,
          "wall": time.time(), "monotonic": time.monotonic()})


def _progress(when: str, step: Optional[int]) -> None:
    """A ``progress`` line: the step source of this process and its last step (at exit)."""
    if not os.environ.get(ENV_LOG):
        return
    rank = _who.get("rank", _env_rank())
    attempt = _who.get("attempt", _env_attempt())
    node = _who.get("node") if _who else _env_node()
    _log({"progress": when, "source": SOURCES.get(_level, "none"), "step": step, "rank": rank,
          "node": node, "attempt": attempt, "pid": os.getpid(), "monotonic": time.monotonic()})


def _env_node() -> Optional[int]:
    try:
        return _env_int("GROUP_RANK", None)
    except PlanError:
        return None


def _env_rank() -> Optional[int]:
    try:
        return _env_int("RANK", None)
    except PlanError:
        return None


def _env_attempt() -> Optional[int]:
    try:
        return _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    except PlanError:
        return None


def _log(entry: dict[str, object]) -> None:
    path = os.environ.get(ENV_LOG)
    if not path:
        return
    try:  # one O_APPEND write: lines from several workers never interleave
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)  # a planted symlink is refused (ELOOP), never followed
        try:
            os.write(fd, (json.dumps(entry) + "\n").encode())
        finally:
            os.close(fd)
    except OSError as e:
        print(f"elastictk.faults: cannot append to {ENV_LOG}={path}: {e}", file=sys.stderr)


def _reset() -> None:
    """Forget the plan (tests, and a forked child that must re-read its own environment)."""
    global _next, _due, _who, _level, hang_armed, _plan, _last_step, _reported
    with _lock:
        _next, _due, _who, _level, hang_armed = -math.inf, [], {}, 0, None
        _plan, _last_step, _reported = None, None, False
        _fired.clear()

"""The in-worker injector: ``elastictk.faults.checkpoint(step)`` performs the plan's step faults
for real, at the exact step, in the worker they target.

::

    for step in range(start, steps):
        elastictk.faults.checkpoint(step)
        train_step(...)

Cost without a plan: one comparison. The plan (``ELASTICTK_FAULT_PLAN``) is read on the first
call only; the faults kept are those hitting this worker (``RANK``, or its node ``GROUP_RANK``)
in this attempt (``TORCHELASTIC_RESTART_COUNT``), and ``_next`` holds the first step due (or
infinity), so every later call is ``step < _next``.

A fault fires the first time ``checkpoint`` sees a step at or past its own (a job resumed from a
checkpoint beyond it still gets it), at most once per process, and only in its attempt, which is
what makes it once per job. What each kind does, in the worker:

- ``sigkill`` / ``sigterm`` / ``hang``: the signal (SIGKILL, SIGTERM, SIGSTOP) sent to itself.
- ``sigsegv``: a real invalid read (``ctypes.string_at(0)``): the kernel's SIGSEGV.
- ``exception``: raises :class:`InjectedFault` from ``checkpoint``; ``exit:<code>``:
  ``sys.exit(code)``. Both unwind through the user's code like the real thing.
- ``slow:<s>``: sleeps ``s`` seconds: the peers wait for it in their next collective.
- ``hang-in-collective``: the worker's next ``all_reduce`` never returns (see ``auto``).

Each fault is announced first: one line on stderr and, with ``ELASTICTK_FAULT_LOG``, one JSON
line appended to that file.
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

from .env import ENV_LOG, ENV_PLAN
from .kinds import PlanError
from .plan import Fault, FaultPlan


class InjectedFault(RuntimeError):
    """The ``exception`` fault: raised by ``checkpoint`` at the planned step."""


# Module state: the hot path reads _next only. -inf: the plan was not read yet.
_next: float = -math.inf
_due: list[tuple[int, Fault]] = []  # (plan index, fault), in step order
_who: dict[str, Optional[int]] = {}
_user_steps = False  # checkpoint() was called: the automatic step count stands aside
hang_armed: Optional[tuple[int, Fault]] = None  # read by the all_reduce wrapper
_lock = threading.RLock()


def checkpoint(step: int) -> None:
    """Perform the faults planned for this worker at ``step`` (see the module's docstring)."""
    if step < _next:
        return
    _reached(step, "checkpoint")


def auto_step(step: int) -> None:
    """The automatic mode's step (counted collectives); ignored once ``checkpoint`` is used."""
    if step >= _next and not _user_steps:
        _reached(step, "auto")


def arm(plan: FaultPlan, *, rank: int, node: Optional[int] = None, attempt: int = 0) -> int:
    """Keep the step faults of ``plan`` that hit this worker in this attempt; returns how many.

    ``checkpoint`` does this itself from the environment; call it to inject without a launcher.
    """
    global _next, _due, _who
    with _lock:
        _due = [p for p in plan.step_faults(rank, node, attempt)]
        _who = {"rank": rank, "node": node, "attempt": attempt}
        _next = _due[0][1].at_step if _due else math.inf  # type: ignore[assignment]
        if any(f.kind == "hang-in-collective" for _, f in _due):
            from .auto import ensure_wrapped

            ensure_wrapped()
        return len(_due)


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
    global _next, _user_steps
    if _next == -math.inf:
        load_from_env()
    with _lock:
        if source == "checkpoint":
            _user_steps = True
        fire: list[tuple[int, Fault]] = []
        while _due and _due[0][1].at_step <= step:  # type: ignore[operator]
            fire.append(_due.pop(0))
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
    path = os.environ.get(ENV_LOG)
    if not path:
        return
    entry = {"fault": index, "kind": fault.spec, "target": str(fault.target), "rank": rank,
             "node": _who.get("node"), "attempt": _who.get("attempt"), "step": step,
             "planned_step": fault.at_step, "pid": os.getpid(), "source": source,
             "wall": time.time(), "monotonic": time.monotonic()}
    try:  # one O_APPEND write: lines from several workers never interleave
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(entry) + "\n").encode())
        finally:
            os.close(fd)
    except OSError as e:
        print(f"elastictk.faults: cannot append to {ENV_LOG}={path}: {e}", file=sys.stderr)


def _reset() -> None:
    """Forget the plan (tests, and a forked child that must re-read its own environment)."""
    global _next, _due, _who, _user_steps, hang_armed
    with _lock:
        _next, _due, _who, _user_steps, hang_armed = -math.inf, [], {}, False, None

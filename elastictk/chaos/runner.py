"""Run one job under ``elastictk-run`` with a fault plan, and record what happened.

The job runs as a child ``python -m elastictk.run``: the same agent, flags and worker set-up a
user gets, nothing special-cased. The plan reaches the workers through the environment (step
faults fire inside them, see ``elastictk.faults.inworker``); time faults are signals sent from
here, only to PIDs the agent itself reported in its event log and only while they are still
descendants of the launcher we started, so nothing outside the job is ever touched.

The runner owns the job: the launcher dies with it (``PR_SET_PDEATHSIG``, and the launcher's
death watch then takes its workers), and SIGTERM, SIGINT or SIGHUP to this process (see
:func:`owning_signals`) or the run's ``timeout`` stop the launcher with SIGTERM, then SIGKILL
after a grace period.

What the run records is ``record.py``'s, the signals of time faults ``outside.py``'s, what it
left behind ``leaks.py``'s.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from .._paths import open_append, write_file
from ..faults import FaultPlan
from ..faults.env import AUTO_OPTIMIZER, private_site, worker_env
from ..lifetime.reaper import dies_with_caller
from ..lifetime.sigflag import SignalFlag
from ..metrics.events import read_events
from .leaks import _listening, _shm, record_leaks
from .outside import _inject_outside, late
from .record import RunRecord, read_fault_log, read_worker_records

STEP_LINE = re.compile(r"\bstep (\d+)\b")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_GRACE_S = 30.0  # after SIGTERM, how long the launcher gets to stop its workers
FIRST_WORKERS_WAIT = 120.0  # no workers by then: time faults count from then (they find no target)

_stop = SignalFlag()  # raised by a signal handler: a threading.Event there can deadlock
_stopped_by: list[int] = []


@contextmanager
def owning_signals() -> Iterator[None]:
    """While inside, SIGTERM/SIGINT/SIGHUP do not kill this process at once: they stop the
    running job (its launcher gets SIGTERM, then SIGKILL), and :func:`stopped_by` names the
    signal afterwards. The handlers before are restored on the way out."""
    def handler(signum: int, frame: Any) -> None:
        _stopped_by.append(signum)
        _stop.set()

    _stop.clear()
    _stopped_by.clear()
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only: its owner handles them
        return
    old = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def stopped_by() -> Optional[int]:
    """The signal that stopped the run, or None."""
    return _stopped_by[0] if _stopped_by else None


def stop_requested() -> bool:
    return _stop.is_set()



def with_run_dir(command: Sequence[str], out_dir: Path, tag: str) -> list[str]:
    """``command`` with ``{run_dir}`` standing for ``<out_dir>/<tag>-run``, a directory of this
    run's own (per-run checkpoints), made before the script runs: a script that opens a file in
    it must not fail on a directory it was promised."""
    run_dir = make_run_dir(out_dir, tag)
    return [a.replace("{run_dir}", str(run_dir)) for a in command]


def make_run_dir(out_dir: Path, tag: str) -> Path:
    """``<out_dir>/<tag>-run``, made (what ``{run_dir}`` in the command stands for)."""
    run_dir = out_dir / f"{tag}-run"
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def keep_output(rec: RunRecord, logs: Path) -> Path:
    """Write the job's relayed stdout and stderr into ``logs`` (made if missing), where error
    lines point; returns the stdout file. Each file is renamed into place (``_paths``): a
    symlink planted under its name is replaced, never followed."""
    logs.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_file(logs / "job-stderr.log", rec.stderr)
    return write_file(logs / "job-stdout.log", rec.stdout)


def fresh_log(path: Path) -> None:
    """``path`` made anew, empty and this user's (``O_NOFOLLOW``): what a file left there
    before (or a symlink) held never reaches the report, and a link is never followed."""
    path.unlink(missing_ok=True)
    os.close(open_append(path))


def launcher_argv(launcher_flags: Sequence[str], command: Sequence[str], events: Path, logs: Path) -> list[str]:
    """``python -m elastictk.run`` with the user's flags plus where the events and logs go."""
    return [sys.executable, "-m", "elastictk.run", *launcher_flags, "--event-log", str(events),
            "--log-dir", str(logs), *command]


def run_job(plan: Optional[FaultPlan], launcher_flags: Sequence[str], command: Sequence[str],
            out_dir: Path, *, timeout: float, progress: Optional[Callable[[RunRecord], None]] = None,
            tag: str = "chaos", auto_steps: bool = True) -> RunRecord:
    """Run the job to its end (or ``timeout``), injecting ``plan``; return the record. The
    workers' sitecustomize lives in a private temporary directory for the run's length."""
    with contextlib.ExitStack() as stack:
        site = stack.enter_context(private_site()) if plan is not None and auto_steps else None
        return _run_job(plan, launcher_flags, command, out_dir, timeout=timeout, progress=progress,
                        tag=tag, auto_steps=auto_steps, site=site)


def _run_job(plan: Optional[FaultPlan], launcher_flags: Sequence[str], command: Sequence[str],
             out_dir: Path, *, timeout: float, progress: Optional[Callable[[RunRecord], None]],
             tag: str, auto_steps: bool, site: Optional[str]) -> RunRecord:
    out_dir.mkdir(parents=True, exist_ok=True)
    events, fault_log = out_dir / f"{tag}-events.jsonl", out_dir / f"{tag}-faults.jsonl"
    events.unlink(missing_ok=True)
    fresh_log(fault_log)
    # The agent relays worker output through its own stdout: unbuffered, lines arrive as printed.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = with_run_dir(command, out_dir, tag)
    if plan is not None:
        env.update(fault_env(plan, out_dir, tag, fault_log, auto_steps=auto_steps, site=site))
    argv = launcher_argv(launcher_flags, command, events, out_dir / f"{tag}-logs")
    shm_before, ports_before = _shm(), _listening()
    rec = RunRecord(argv=argv, started=time.monotonic())
    if _stop.is_set():
        raise Stopped(stopped_by())
    # The launcher dies with this process (PR_SET_PDEATHSIG), its workers with the launcher.
    proc = subprocess.Popen(argv, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=dies_with_caller())
    rec.pids.add(proc.pid)
    out_lines: list[str] = []
    err_lines: list[str] = []
    readers = [threading.Thread(target=_read, args=(proc.stdout, out_lines, rec), daemon=True),
               threading.Thread(target=_read, args=(proc.stderr, err_lines, None), daemon=True)]
    for t in readers:
        t.start()
    outside = [(i, f) for i, f in (plan.time_faults() if plan is not None else [])]
    due: list[tuple[int, Any]] = []
    deadline = rec.started + timeout
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if now > deadline or _stop.is_set():
                rec.stopped = "timeout" if not _stop.is_set() else signal.Signals(stopped_by() or 15).name
                stop_process(proc)
                break
            _refresh(rec, events, fault_log, proc.pid)
            if outside and rec.clock is None:  # time faults count from when workers first ran
                rec.clock = first_workers_at(rec.events)
                if rec.clock is None and now - rec.started > FIRST_WORKERS_WAIT:
                    rec.clock = now
            while outside and rec.clock is not None and now - rec.clock >= float(outside[0][1].at_s or 0):
                due.append(outside.pop(0))
            for item in list(due):  # a target between rounds is hit once it runs again
                index, fault = item
                inj = _inject_outside(index, fault, rec, proc.pid)
                if inj is not None:
                    rec.injections.append(inj)
                    rec.unfired.pop(index, None)
                if inj is not None or late(rec, fault, now):
                    due.remove(item)
            if progress is not None:
                progress(rec)
            _stop.wait(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for t in readers:
            t.join(10)
    rec.ended = time.monotonic()
    rec.exit_code = proc.returncode
    rec.stdout, rec.stderr = "".join(out_lines), "".join(err_lines)
    _refresh(rec, events, fault_log, proc.pid)
    record_leaks(rec, shm_before, ports_before)
    if progress is not None:
        progress(rec)
    return rec


def first_workers_at(events: Sequence[Any]) -> Optional[float]:
    """When the job's workers first ran (its first ``workers_started``): where planned times
    start counting, so a fault due at 2 s never lands while the launcher is still starting
    (which takes seconds on a loaded machine), as with several nodes."""
    return next((float(e.mono) for e in events if e.kind == "workers_started"), None)


class Stopped(Exception):
    """The run was stopped by a signal before it started."""


def stop_process(proc: "subprocess.Popen[str]", grace: float = STOP_GRACE_S) -> None:
    """SIGTERM the launcher (it stops its workers), SIGKILL it after ``grace`` (its death watch
    then kills the workers)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()


def fault_env(plan: FaultPlan, out_dir: Path, tag: str, fault_log: Path,
              auto_steps: bool = True, site: Optional[str] = None) -> dict[str, str]:
    """The workers' environment that arms the plan's step faults (saved next to the report);
    ``auto_steps`` counts optimizer steps for scripts that never call ``checkpoint``, through
    the sitecustomize in ``site`` (:func:`~elastictk.faults.env.private_site`)."""
    return worker_env(plan.save(out_dir / f"{tag}-plan.json"), log_path=fault_log,
                      auto=AUTO_OPTIMIZER if auto_steps else 0, site=site)


def _read(stream: Any, sink: list[str], rec: Optional[RunRecord]) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line)
        if rec is not None:
            m = STEP_LINE.search(line)
            if m:
                rec.steps.append((time.monotonic(), int(m.group(1))))


def _refresh(rec: RunRecord, events: Path, fault_log: Path, launcher: int) -> None:
    """Re-read the event log (PIDs of every attempt) and the workers' fault log."""
    if events.exists():
        rec.events = read_events(events)
        for e in rec.events:
            if e.kind == "workers_started":
                pids = e.fields.get("pids") or {}
                rec.pids.update(int(p) for p in pids.values())
                rec.ranks_seen.update(int(r) for r in pids)  # local rank == global on one node
            elif e.kind == "inplace_recovery":
                rec.pids.update(int(p) for p in (e.fields.get("replaced") or {}).values()
                                if str(p).isdigit())
    inside = [i for i in rec.injections if i.how == "outside"] + read_fault_log(fault_log)
    rec.injections = sorted(inside, key=lambda i: i.mono)
    read_worker_records(rec, fault_log)

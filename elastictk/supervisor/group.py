"""The local worker group: start N workers for an attempt, see each exit as it happens, stop all.

An agent drives it as a loop::

    group = WorkerGroup(spec, log_dir)
    group.prepare()                              # optional: start helpers early
    group.start(attempt, assignment)
    while group.running:
        for result in group.wait_any(timeout):   # returns the moment a worker exits
            ...                                  # decide: keep waiting, or stop and restart
    group.stop()                                 # SIGTERM trees, grace, SIGKILL, reap
    group.close()

``wait_any`` blocks in one ``select`` on every worker's exit fd (pidfd) and result pipe plus a
wakeup pipe, so it returns on the first exit, on ``wake()`` (another thread or a signal handler
wants the agent's attention) or on the timeout; it never sleeps in a polling loop.

The group decides when each rank starts, what its exit means and when the attempt ends; its
parts live beside it: ``exitwatch`` (the one ``select``), ``escalate`` (the stop sequence),
``starter`` (the start methods and their helpers), ``grouplogs`` (the log tree and tee pumps).

Ownership: the group owns its workers and their whole process trees (each worker leads its own
session; the agent becomes a child subreaper so orphaned grandchildren come back to it), the
death watch that kills those sessions if the agent is SIGKILLed, the log pump, and the preload
fork server unless one was passed in. ``close()`` releases all of it.

Hygiene (PIDs are reused): which processes are the workers' is ``sessions.WorkerSessions``'s
business; the select loop calls its sweep about every ``SWEEP_EVERY`` seconds, never touching
the workers' or helpers' own exit statuses. A worker's return value is read without blocking,
so a worker frozen while sending it stalls nothing.

Threading: ``start``/``wait_any``/``stop``/``close`` belong to one thread, which must live as long
as the workers (the kernel's parent-death signal fires when the *thread* that started a worker
exits). ``wake`` and ``signal_all`` may be called from any thread or a signal handler.
"""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

from .env import Assignment
from .escalate import KILL_WAIT, escalate
from .exitwatch import ExitWatch
from .forkserver import PreloadServer
from .grouplogs import GroupLogs
from .logpump import Console
from .process import WorkerProcess
from ..lifetime.reaper import acquire_subreaper, release_child, release_subreaper
from .sessions import WorkerSessions
from .spec import WorkerResult, WorkerSpec
from .starter import WorkerStarter

_PUMP_DRAIN = 5.0  # how long stop() waits for tee pipes to drain


class GroupStateError(RuntimeError):
    """A call that does not fit the group's state (start while an attempt is open, ...)."""


class StartInterrupted(RuntimeError):
    """``interrupt()`` came before every worker had started; those started were stopped.

    Starting many workers takes a while (a fork and a handshake each), and a SIGTERM from a
    scheduler or ``timeout`` must not wait for the last one: the agent acts within a worker's
    start time, not after all of them."""


class WorkerGroup:
    """Spawns, watches and stops the local workers of one role, one attempt at a time.

    ``log_dir`` is the root of the per-run log tree (default: a new temp dir, kept). With
    ``start_method="preload"`` the group starts and owns a fork server importing
    ``preload_modules`` (default ``DEFAULT_PRELOAD``) unless ``preload_server`` is given, which
    the caller then owns (one server can serve several groups). ``console`` is where tee'd
    lines go (fds or text streams; default the caller's ``sys.stdout``/``sys.stderr``).
    ``subreaper``/``death_watch`` exist for tests of what happens without them.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        log_dir: str | Path | None = None,
        *,
        preload_server: Optional[PreloadServer] = None,
        preload_modules: Optional[Sequence[str]] = None,
        console: tuple[Console, Console] = (None, None),
        subreaper: bool = True,
        death_watch: bool = True,
    ) -> None:
        self.spec = spec
        self._logs = GroupLogs(spec, Path(log_dir) if log_dir is not None else None, console)
        self._subreaper = subreaper
        self._subreaper_held = False
        self._sessions = WorkerSessions(death_watch)
        self._starter = WorkerStarter(spec, preload_server, preload_modules)
        self._exits = ExitWatch()
        self._workers: dict[int, WorkerProcess] = {}
        self._results: dict[int, WorkerResult] = {}
        self._extra_env: dict[str, str] = {}
        self.from_standby: list[int] = []  # pids of replacements that were the standby
        self.replaced: list[WorkerResult] = []
        self._assignment: Optional[Assignment] = None
        self.attempt: Optional[int] = None
        self._open = False
        self._stopping = False
        self._closed = False
        self._interrupted = False

    # -- lifecycle -------------------------------------------------------------------------

    def prepare(self) -> None:
        """Start the helpers now (death watch, preload server import) rather than at ``start``,
        e.g. so the preload import overlaps rendezvous."""
        self._check_not_closed()
        if self._subreaper and not self._subreaper_held:
            acquire_subreaper()
            self._subreaper_held = True
        self._sessions.start()
        self._starter.prepare()

    def start(self, attempt: int, assignment: Assignment,
              extra_env: Optional[dict[str, str]] = None) -> None:
        """Start ``local_world_size`` workers for ``attempt`` (the log directory number).

        ``assignment.restart_count`` is what the workers see as TORCHELASTIC_RESTART_COUNT; the
        attempt number is separate so a re-rendezvous that does not consume a restart still gets
        fresh log directories. ``extra_env`` is added to every worker's environment (after the
        spec's). Raises (after killing any worker it started) if a worker cannot be started.
        """
        self._check_not_closed()
        if self._open:
            raise GroupStateError(f"attempt {self.attempt} is still open; call stop() before "
                                  f"starting attempt {attempt}")
        spec = self.spec
        assignment.check(spec.local_world_size)
        self.prepare()
        self._logs.begin(attempt, assignment)
        self.attempt, self._assignment = attempt, assignment
        self._workers, self._results = {}, {}
        self._extra_env = dict(extra_env or {})
        self.replaced = []
        self._stopping = False
        self._open = True
        try:
            envs = self._logs.open(assignment, range(spec.local_world_size), self._extra_env)
            for lr in range(spec.local_world_size):
                if self._interrupted:
                    raise StartInterrupted(f"interrupted after {lr} of {spec.local_world_size} "
                                           "workers had started; they were stopped")
                w = self._workers[lr] = self._start_one(lr, envs[lr])
                self._logs.ranks[lr].close_child_ends()
                self._register(w)
        except BaseException:
            for logs in self._logs.ranks.values():
                logs.close_child_ends()
            self.stop(grace=0)
            raise

    def respawn(self, local_rank: int, restart_count: int, tag: str,
                env: Optional[Mapping[str, str]] = None) -> int:
        """Start a new worker for ``local_rank``, whose exit was observed, within the open
        attempt (in-place recovery: the other workers keep running). Its logs go to
        ``attempt_<n>/<tag>/<local_rank>/`` (with ``logs_specs``, where its ``reify`` puts a
        worker with this restart count, appended to); it sees
        ``TORCHELASTIC_RESTART_COUNT=restart_count`` and ``env`` over the group's environment.
        The old result moves to :attr:`replaced`. Returns the new pid.
        """
        if not self._open or local_rank not in self._results:
            raise GroupStateError(f"local rank {local_rank} has no observed exit in an open "
                                  "attempt; only an exited worker can be replaced")
        assert self._assignment is not None
        from dataclasses import replace

        self._assignment = replace(self._assignment, restart_count=restart_count)
        self.replaced.append(self._results.pop(local_rank))
        env = {**self._logs.open(self._assignment, [local_rank], self._extra_env, tag)[local_rank], **(env or {})}
        logs = self._logs.ranks[local_rank]
        try:
            w = self._workers[local_rank] = self._start_one(local_rank, env,
                                                            standby=self._starter.standby)
        finally:
            logs.close_child_ends()
        self._register(w)
        if getattr(w, "from_standby", False):
            self.from_standby.append(w.pid)
        return w.pid

    def keep_standby(self) -> bool:
        """Have the preload server keep one warmed standby that the next ``respawn`` becomes
        (no fork, no process start; see ``forkserver``); False where workers do not fork
        from a preload server. The standby is no worker: not in ``pids``, not a rank."""
        self._check_not_closed()
        return self._starter.keep_standby()

    def reassign(self, assignment: Assignment, extra_env: Optional[dict[str, str]] = None) -> None:
        """Nodes joined or left while the workers kept running (in-place): later replacements
        and results use the new ranks. The running workers learn theirs from the generation."""
        if not self._open:
            raise GroupStateError("no open attempt to reassign; start() one first")
        assignment.check(self.spec.local_world_size)
        self._assignment = assignment
        if extra_env is not None:
            self._extra_env = dict(extra_env)

    def _register(self, w: WorkerProcess) -> None:
        """Watch a started worker: its session, its death watch, its exit (pidfd) and its result
        pipe. The worker is held (alive or an unreaped zombie), so its start time is its own."""
        self._sessions.add(w.pid)
        self._exits.add(w)

    def _start_one(self, local_rank: int, env: dict[str, str], standby: bool = False) -> WorkerProcess:
        return self._starter.start(local_rank, env, self._logs.ranks[local_rank],
                                   lambda: self._private_fds(exclude_rank=local_rank), standby)

    def _private_fds(self, exclude_rank: int) -> list[int]:
        """The agent's own fds, which a fork-started worker closes first (a sibling's tee pipe
        held open by this worker would delay that sibling's EOF)."""
        fds = self._exits.fds() + self._logs.fds(exclude_rank)
        watch_fd = self._sessions.watch_fd()
        if watch_fd is not None:
            fds.append(watch_fd)
        fds += self._starter.fds()
        for w in self._workers.values():
            fds += w.private_fds()
        return fds

    # -- watching --------------------------------------------------------------------------

    @property
    def log_dir(self) -> Optional[Path]:
        """The root of the per-run log tree (a new kept temp dir once started without one)."""
        return self._logs.log_dir

    @property
    def run_log_dir(self) -> Optional[Path]:
        """This run's directory under ``log_dir`` (or the ``logs_specs``'s); None before a start."""
        return self._logs.run_log_dir

    @property
    def attempt_dir(self) -> Optional[Path]:
        """The open (or last) attempt's log directory; None before a start."""
        return self._logs.attempt_dir

    @property
    def death_watch_pid(self) -> Optional[int]:
        """The death watch process's pid (None without one, or before ``prepare``/``start``)."""
        watch = self._sessions.watch
        return watch.pid if watch is not None else None

    @property
    def running(self) -> list[int]:
        """Local ranks whose exit has not been observed yet."""
        return [lr for lr, w in self._workers.items() if lr not in self._results]

    @property
    def results(self) -> dict[int, WorkerResult]:
        """Results of the workers of the current attempt that have exited, by local rank."""
        return dict(self._results)

    def pids(self) -> dict[int, int]:
        return {lr: w.pid for lr, w in self._workers.items()}

    def interrupt(self) -> None:
        """Abandon a ``start`` in progress (it raises :class:`StartInterrupted` before the next
        worker) and refuse later ones; ``wait_any`` returns. One way: for an agent that is
        ending. Safe from any thread or signal handler (a flag and a pipe write)."""
        self._interrupted = True
        self.wake()

    def wake(self) -> None:
        """Make a blocked ``wait_any`` return now. Safe from any thread or signal handler."""
        self._exits.wake()

    def wait_any(self, timeout: Optional[float] = None) -> list[WorkerResult]:
        """Block until at least one worker exits, ``wake()`` is called, or ``timeout`` passes.

        Returns the results of workers whose exit was observed in this call (possibly several,
        possibly none on wake-up or timeout). Returns at once when nothing is running.
        """
        if self._exits.take_pending_wake():  # a wake() that arrived during wait() or stop()
            return []
        return self._dispatch(None if timeout is None else time.monotonic() + timeout,
                              stop_on_first=True)

    def wait(self, timeout: Optional[float] = None) -> dict[int, WorkerResult]:
        """Block until every worker has exited (or ``timeout``); all results so far."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.running and (deadline is None or time.monotonic() < deadline):
            self._dispatch(deadline, stop_on_first=False, ignore_wake=True)
        return self.results

    def _dispatch(self, deadline: Optional[float], *, stop_on_first: bool,
                  ignore_wake: bool = False) -> list[WorkerResult]:
        return self._exits.wait(deadline, running=lambda: bool(self.running),
                                sweep=self._sessions.sweep,
                                on_exit=lambda w: self._finish(w) if self._exited(w) else None,
                                stop_on_first=stop_on_first, ignore_wake=ignore_wake)

    def _exited(self, w: WorkerProcess) -> bool:
        """Its exit fd is readable: pin what is left of its session while the worker is still a
        zombie holding the session id, then reap it (``poll``) and let the id go."""
        if w.returncode is None:
            self._sessions.pin(w.pid)
        if w.poll() is None:
            return False
        self._sessions.released(w.pid)
        return True

    def _finish(self, w: WorkerProcess) -> WorkerResult:
        self._exits.drop(w)
        w.close()  # a preload worker's status pipe: the fork server reaps it now
        release_child(w.pid)
        assert self._assignment is not None and self.attempt is not None
        logs = self._logs.ranks[w.local_rank]
        a = self._assignment
        result = WorkerResult(
            local_rank=w.local_rank, rank=a.global_rank(w.local_rank),
            role_rank=a.role_rank(w.local_rank), role=self.spec.role, attempt=self.attempt,
            pid=w.pid, exitcode=int(w.returncode),  # type: ignore[arg-type]
            started_at=w.started_at, ended_at=w.ended_at or time.monotonic(),
            stdout_path=logs.stdout_path, stderr_path=logs.stderr_path,
            error_file=logs.error_file, return_value=w.return_value, stopped=self._stopping,
        )
        self._results[w.local_rank] = result
        return result

    # -- signalling and stopping -----------------------------------------------------------

    def signal_one(self, local_rank: int, sig: int) -> bool:
        """Send ``sig`` to one running worker (e.g. SIGKILL to a frozen one); False if gone."""
        w = self._workers.get(local_rank)
        if w is None or local_rank in self._results:
            return False
        return w.signal(sig)

    def signal_all(self, sig: int) -> None:
        """Forward ``sig`` to every running worker's process group (what a terminal would do);
        for the agent's SIGTERM/SIGINT/SIGHUP/SIGUSR1/SIGUSR2 handlers."""
        for lr, w in list(self._workers.items()):
            if lr in self._results:
                continue
            # killpg only while the worker holds its id (alive or our unreaped zombie)
            if not self._sessions.signal_group(w.pid, sig):
                w.signal(sig)  # not yet its own group leader (a function worker starting up)

    def stop(self, grace: Optional[float] = None, sig: int = signal.SIGTERM) -> dict[int, WorkerResult]:
        """Stop the attempt: ``sig`` to every worker's whole tree, up to ``grace`` seconds
        (default: the spec's) for them to exit, then SIGKILL to whatever is left. Returns when
        every worker and every descendant found is gone and reaped; all results by local rank.
        """
        if not self._open:
            return self.results
        grace = self.spec.grace_period if grace is None else grace
        self._stopping = True
        # Replaced workers' sessions too: what they left behind dies with the attempt, as far as
        # it is proven to be theirs (TrackedSession); their old ids are never signalled.
        escalate(self._sessions.all(), sig, grace,
                 lambda deadline: self._dispatch(deadline, stop_on_first=False, ignore_wake=True))
        stuck = self.running
        if stuck:  # only a process in uninterruptible sleep survives SIGKILL this long
            print(f"elastictk: local ranks {stuck} did not exit {KILL_WAIT:.0f}s after SIGKILL "
                  "(uninterruptible sleep?); giving up on them", file=sys.stderr)
            for lr in stuck:
                self._exits.drop(self._workers[lr])
        self._logs.close_pumps(_PUMP_DRAIN)
        for w in self._workers.values():
            w.close()
            if w.returncode is not None:
                release_child(w.pid)
        self._sessions.end_attempt()
        self._open = False
        return self.results

    def close(self) -> None:
        """Stop any open attempt and release every helper. Idempotent."""
        if self._closed:
            return
        try:
            if self._open:
                self.stop()
        finally:
            self._closed = True
            self._sessions.close()
            self._starter.close()
            if self._subreaper_held:
                release_subreaper()
                self._subreaper_held = False
            self._exits.close()

    def _check_not_closed(self) -> None:
        if self._closed:
            raise GroupStateError("the worker group is closed; create a new one")

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

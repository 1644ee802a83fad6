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

import os
import selectors
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from .env import Assignment, worker_env
from .forkserver import DEFAULT_PRELOAD, ForkServerError, PreloadServer
from .logs import (
    Console, LogPump, RankLogs, claim_run_dir, closed_on_error as _closed_on_error, line_filters,
    make_attempt_dir, make_private_dir, open_rank_logs, open_reified_rank_logs, reified_filters, reify,
)
from .process import (
    WorkerProcess, acquire_mp_forkserver, release_mp_forkserver, start_multiprocessing,
    start_preloaded, start_subprocess,
)
from ..lifetime.reaper import (
    acquire_subreaper, reap_orphans, release_child, release_subreaper, signal_trees, wait_gone,
)
from .sessions import SWEEP_EVERY, WorkerSessions
from .spec import WorkerResult, WorkerSpec, parse_python_argv

# How long stop() waits for SIGKILLed processes and for tee pipes to drain; past this something
# is stuck in the kernel (D state) and waiting longer would only hang the agent.
_KILL_WAIT = 30.0
_PUMP_DRAIN = 5.0


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
        self.log_dir: Optional[Path] = Path(log_dir) if log_dir is not None else None
        self._console = console
        self._subreaper = subreaper
        self._subreaper_held = False
        self._sessions = WorkerSessions(death_watch)
        self._server = preload_server
        self._own_server = preload_server is None
        self._preload_modules = preload_modules
        self._mp_forkserver = False
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self._workers: dict[int, WorkerProcess] = {}
        self._logs: dict[int, RankLogs] = {}
        self._results: dict[int, WorkerResult] = {}
        self._pump: Optional[LogPump] = None
        self._pumps: list[LogPump] = []  # one per replacement worker (see respawn)
        self._extra_env: dict[str, str] = {}
        self._standby = False  # respawn promotes the preload server's standby (keep_standby)
        self.from_standby: list[int] = []  # pids of replacements that were the standby
        self.replaced: list[WorkerResult] = []
        self._assignment: Optional[Assignment] = None
        self._run_id: Optional[str] = None
        self.run_log_dir: Optional[Path] = None
        self.attempt: Optional[int] = None
        self.attempt_dir: Optional[Path] = None
        self._open = False
        self._stopping = False
        self._closed = False
        self._pending_wake = False
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
        if self.spec.start_method == "preload":
            self._preload_server().start()

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
        if spec.logs_specs is None:  # else the LogsSpecs decides (_open_logs)
            if self.log_dir is None:
                # Logs are the record of a failure: a default dir is created and deliberately kept.
                self.log_dir = Path(tempfile.mkdtemp(prefix="elastictk_"))
            if self.run_log_dir is None or assignment.run_id != self._run_id:
                self.run_log_dir = claim_run_dir(self.log_dir, assignment.run_id)
                self._run_id = assignment.run_id
            self.attempt_dir = make_attempt_dir(self.run_log_dir, attempt)
        self.attempt, self._assignment = attempt, assignment
        self._workers, self._logs, self._results = {}, {}, {}
        self._extra_env = dict(extra_env or {})
        self.replaced = []
        self._stopping = False
        self._open = True
        try:
            pump, envs = self._open_logs(range(spec.local_world_size), self.attempt_dir)
            self._pump = pump
            pump.start()
            for lr in range(spec.local_world_size):
                if self._interrupted:
                    raise StartInterrupted(f"interrupted after {lr} of {spec.local_world_size} "
                                           "workers had started; they were stopped")
                w = self._workers[lr] = self._start_one(lr, envs[lr])
                self._logs[lr].close_child_ends()
                self._register(w)
        except BaseException:
            for logs in self._logs.values():
                logs.close_child_ends()
            self.stop(grace=0)
            raise

    def respawn(self, local_rank: int, restart_count: int, tag: str) -> int:
        """Start a new worker for ``local_rank``, whose exit was observed, within the open
        attempt (in-place recovery: the other workers keep running). Its logs go to
        ``attempt_<n>/<tag>/<local_rank>/`` (with ``logs_specs``, where its ``reify`` puts a
        worker with this restart count, appended to); it sees
        ``TORCHELASTIC_RESTART_COUNT=restart_count``.
        The old result moves to :attr:`replaced`. Returns the new pid.
        """
        if not self._open or local_rank not in self._results:
            raise GroupStateError(f"local rank {local_rank} has no observed exit in an open "
                                  "attempt; only an exited worker can be replaced")
        assert self._assignment is not None
        from dataclasses import replace

        self._assignment = replace(self._assignment, restart_count=restart_count)
        self.replaced.append(self._results.pop(local_rank))
        sub = None
        if self.spec.logs_specs is None:
            assert self.attempt_dir is not None
            sub = self.attempt_dir / tag
            make_private_dir(sub, exist_ok=True)
        pump, envs = self._open_logs([local_rank], sub, replacement=True)
        self._pumps.append(pump)
        logs, env = self._logs[local_rank], envs[local_rank]
        pump.start()
        try:
            w = self._workers[local_rank] = self._start_one(local_rank, env, standby=self._standby)
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
        if self.spec.start_method != "preload":
            return False
        recipe: dict[str, object] = {"cwd": os.getcwd()}
        target = None if self.spec.is_function else parse_python_argv(self.spec.argv(0))
        if target is not None:  # what the standby may import ahead (forkwarm.prewarm)
            recipe.update(kind=target.kind, target=target.target)
        self._preload_server().keep_standby(recipe)
        self._standby = True
        return True

    def _open_logs(self, ranks: Sequence[int], where: Optional[Path], replacement: bool = False
                   ) -> tuple[LogPump, dict[int, dict[str, str]]]:
        """Open the logs of ``ranks`` (into ``self._logs``) under ``where`` in elastictk's layout,
        or where the spec's ``logs_specs`` says; returns their pump and their environments."""
        spec, a = self.spec, self._assignment
        assert a is not None

        def env(lr: int, error_file: Optional[str], base: dict[str, str],
                extra: Optional[dict[str, str]]) -> dict[str, str]:
            return worker_env(a, role=spec.role, local_rank=lr, local_world_size=spec.local_world_size,
                              error_file=error_file, base_env=base, extra=extra,
                              virtual_local_rank=spec.virtual_local_rank)

        base, extra = dict(os.environ), {**spec.env, **self._extra_env}
        envs: dict[int, dict[str, str]] = {}
        if spec.logs_specs is None:
            assert where is not None and self.attempt_dir is not None
            pump = LogPump(*self._console, filters=line_filters(spec, self.attempt_dir))
            with _closed_on_error(pump):
                for lr in ranks:
                    logs = self._logs[lr] = open_rank_logs(spec, where, lr, a.global_rank(lr), pump)
                    envs[lr] = env(lr, logs.error_file, base, extra)
            return pump, envs
        # torch's reify sees torch's variables only, for every local rank, and may change them
        visible = {k: base[k] for k in ("CUDA_VISIBLE_DEVICES",) if k in base}  # as torch's envs
        dest = reify(spec.logs_specs, {lr: env(lr, None, visible, None)
                                       for lr in range(spec.local_world_size)})
        if not replacement:
            self.attempt_dir = dest.attempt_dir
            self.run_log_dir = dest.run_dir or Path(str(getattr(spec.logs_specs, "root_log_dir", os.devnull)))
        pump = LogPump(*self._console, filters=reified_filters(spec, dest))
        with _closed_on_error(pump):
            for lr in ranks:
                logs = self._logs[lr] = open_reified_rank_logs(spec, dest, lr, a.global_rank(lr),
                                                               pump, append=replacement)
                envs[lr] = {**env(lr, logs.error_file, base, extra), **dest.env[lr]}
        return pump, envs

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
        self._sel.register(w.exit_fd(), selectors.EVENT_READ, ("exit", w))
        fd = w.result_fd()
        if fd is not None:
            self._sel.register(fd, selectors.EVENT_READ, ("result", w))

    def _start_one(self, local_rank: int, env: dict[str, str], standby: bool = False) -> WorkerProcess:
        spec, logs = self.spec, self._logs[local_rank]
        method = spec.start_method
        if method == "subprocess":
            return start_subprocess(local_rank, spec.argv(local_rank), env, logs, spec.death_signal)
        if method == "preload":
            server = self._preload_server()
            if spec.is_function:
                return start_preloaded(local_rank, server, env, logs, spec.death_signal,
                                       fn=spec.entrypoint,  # type: ignore[arg-type]
                                       args=spec.rank_args(local_rank), sys_path=sys.path,
                                       standby=standby)
            target = parse_python_argv(spec.argv(local_rank))
            return start_preloaded(local_rank, server, env, logs, spec.death_signal, target=target,
                                   standby=standby)
        import torch.multiprocessing as tmp  # lazily: only function workers need torch here

        if method == "forkserver" and not self._mp_forkserver:
            acquire_mp_forkserver()
            self._mp_forkserver = True
        return start_multiprocessing(
            local_rank, tmp.get_context(method), spec.entrypoint,  # type: ignore[arg-type]
            spec.rank_args(local_rank), env, logs, spec.death_signal,
            self._private_fds(exclude_rank=local_rank))

    def _preload_server(self) -> PreloadServer:
        if self._server is None:
            modules = DEFAULT_PRELOAD if self._preload_modules is None else self._preload_modules
            self._server = PreloadServer(preload=modules)
        return self._server

    def _private_fds(self, exclude_rank: int) -> list[int]:
        """The agent's own fds, which a fork-started worker closes first (a sibling's tee pipe
        held open by this worker would delay that sibling's EOF)."""
        fds = [self._wake_r, self._wake_w, self._sel.fileno()]
        for lr, logs in self._logs.items():
            if lr != exclude_rank:
                fds += logs.owned_fds()
        if self._pump is not None:
            fds += self._pump.fds()
        for pump in self._pumps:
            fds += pump.fds()
        watch_fd = self._sessions.watch_fd()
        if watch_fd is not None:
            fds.append(watch_fd)
        if self._server is not None and self._server.fileno() is not None:
            fds.append(self._server.fileno())  # type: ignore[arg-type]
        for w in self._workers.values():
            fds += w.private_fds()
        return fds

    # -- watching --------------------------------------------------------------------------

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
        fd = self._wake_w
        if fd < 0:
            return  # closed: a late watch thread must not write into a reused fd number
        try:
            os.write(fd, b"\0")
        except (BlockingIOError, OSError):
            pass

    def wait_any(self, timeout: Optional[float] = None) -> list[WorkerResult]:
        """Block until at least one worker exits, ``wake()`` is called, or ``timeout`` passes.

        Returns the results of workers whose exit was observed in this call (possibly several,
        possibly none on wake-up or timeout). Returns at once when nothing is running.
        """
        if self._pending_wake:  # a wake() that arrived during wait() or stop()
            self._pending_wake = False
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
        new: list[WorkerResult] = []
        while self.running:
            self._sessions.sweep()
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            remaining = SWEEP_EVERY if remaining is None else min(remaining, SWEEP_EVERY)
            woke = False
            for key, _ in self._sel.select(remaining):
                kind, w = key.data
                if kind == "wake":
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    woke = not ignore_wake
                    self._pending_wake = self._pending_wake or ignore_wake
                elif w.local_rank in self._results:
                    continue  # finished earlier in this batch; its fds are unregistered
                elif kind == "result":
                    if w.take_result():
                        self._sel.unregister(key.fd)
                elif self._exited(w):
                    new.append(self._finish(w))
            if new and stop_on_first or woke:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
        return new

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
        for fd in (w.exit_fd(), w.result_fd()):
            if fd is not None and fd >= 0:
                try:
                    self._sel.unregister(fd)
                except KeyError:
                    pass
        w.close()  # a preload worker's status pipe: the fork server reaps it now
        release_child(w.pid)
        assert self._assignment is not None and self.attempt is not None
        logs = self._logs[w.local_rank]
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
        sessions = self._sessions.all()
        deadline = time.monotonic() + grace
        if grace > 0:
            tree = signal_trees(sessions, sig)
            if sig != signal.SIGCONT:
                # A frozen worker (SIGSTOP, a fault, a debugger) acts on the signal only once
                # it runs again; without this it would sit out the whole grace period.
                for session in sessions:
                    session.signal(signal.SIGCONT)
            self._dispatch(deadline, stop_on_first=False, ignore_wake=True)
            wait_gone(tree, max(0.0, deadline - time.monotonic()))
        signal_trees(sessions, signal.SIGKILL)
        self._dispatch(time.monotonic() + _KILL_WAIT, stop_on_first=False, ignore_wake=True)
        # A last sweep: descendants orphaned while we were killing their parents.
        leftovers = signal_trees(sessions, signal.SIGKILL)
        wait_gone(leftovers, _KILL_WAIT)
        reap_orphans()  # workers are reaped by their own objects (claimed)
        stuck = self.running
        if stuck:  # only a process in uninterruptible sleep survives SIGKILL this long
            print(f"elastictk: local ranks {stuck} did not exit {_KILL_WAIT:.0f}s after SIGKILL "
                  "(uninterruptible sleep?); giving up on them", file=sys.stderr)
            for lr in stuck:
                w = self._workers[lr]
                for fd in (w.exit_fd(), w.result_fd()):
                    if fd is not None and fd >= 0 and fd in self._sel.get_map():
                        self._sel.unregister(fd)
        if self._pump is not None:
            self._pump.close(_PUMP_DRAIN)
            self._pump = None
        for pump in self._pumps:
            pump.close(_PUMP_DRAIN)
        self._pumps = []
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
            if self._server is not None and self._own_server:
                self._server.close()
            elif self._server is not None and self._standby:
                try:  # a shared server: this group's standby goes with the group
                    self._server.drop_standby()
                except ForkServerError:
                    pass  # the server is gone, and its standby with it
            if self._mp_forkserver:
                release_mp_forkserver()
                self._mp_forkserver = False
            if self._subreaper_held:
                release_subreaper()
                self._subreaper_held = False
            self._sel.close()
            wake_r, wake_w, self._wake_r, self._wake_w = self._wake_r, self._wake_w, -1, -1
            os.close(wake_r)
            os.close(wake_w)

    def _check_not_closed(self) -> None:
        if self._closed:
            raise GroupStateError("the worker group is closed; create a new one")

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

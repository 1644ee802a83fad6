"""A three-node job on loopback, watched from outside: three launchers, their lines, their workers.

The propagation benchmark starts one launcher process per "node" (``torchrun`` or
``elastictk-run`` with ``--nnodes 3``), all on this machine and sharing one c10d rendezvous
endpoint, the way three hosts of a cluster would. A reader thread per node stamps every line of
that launcher's merged stdout/stderr with ``time.monotonic()`` as it arrives and folds it into
one shared :class:`Timeline`; waits are on a condition notified per line, never on sleeps.

What the lines say, as ``examples/train.py`` and the launchers write them:

- ``[rank R] step S loss ...``: rank R finished step S;
- ``[rank R] resumed at step S (attempt A)``: a restarted rank loaded the checkpoint; only a step
  line after a rank's last such line belongs to the attempt that ran to the end;
- ``final checksum H after S steps``: the job's result, identical for every correct run;
- ``[elastictk-run] <event> k=v ...``: elastictk's agent transitions;
- with ``LOGLEVEL=INFO``, torchrun's agent says ``Worker group FAILED`` (its own worker failed),
  ``Detected N new nodes`` (a peer re-joined the rendezvous) and ``Stopping worker group``.

Workers run with ``python -u``, which may glue two ranks' lines together on a shared pipe, so
every pattern is searched anywhere in a line, as often as it occurs.

Finding the workers: torchrun execs each worker with ``RANK`` in its environment, readable in
``/proc/<pid>/environ``. elastictk forks Python workers from its preload server, whose environ
block is what ``/proc`` shows for them, so there the pids come from the agent's own
``workers_started`` line, and the node's group rank from its ``round_joined`` line.

Exits are watched with pidfds (:class:`ExitWatch`): the kernel marks a pidfd readable the moment
its process terminates, whoever its parent is, so the stop times are exact to the wake-up of one
``poll`` and no pid can be confused with a recycled one.
"""
from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import psutil

from ._trainlog import AGENT_EVENT, FINAL, PIDS, TORCH_WORKER_FAILED, WORKER
from ._launched import descendants, launch, launcher_env, read_stamped, reap, wait_until
from .common import BenchError

GROUP_RANK = re.compile(r"\brank=(\d+)")
TORCH_EVENTS = (
    (re.compile(r"Worker group (?:FAILED|UNHEALTHY)"), "torch_group_failed"),
    (re.compile(r"Detected \d+ new nodes"), "torch_peer_waiting"),
    (re.compile(r"Stopping worker group"), "torch_stopping"),
    TORCH_WORKER_FAILED,
    (re.compile(r"Starting worker group"), "torch_starting"),
)


@dataclass
class Timeline:
    """What the three nodes' output said, and when (monotonic seconds)."""

    steps: list[tuple[float, int, int]] = field(default_factory=list)  # (t, rank, step)
    resumed: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, rank, step, attempt)
    events: list[tuple[float, int, str, str]] = field(default_factory=list)  # (t, node, name, rest)
    finals: list[tuple[float, str, int]] = field(default_factory=list)  # (t, checksum, steps)
    last_step: dict[int, int] = field(default_factory=dict)
    eof: dict[int, float] = field(default_factory=dict)

    def parse(self, node: int, t: float, line: str) -> None:
        for m in WORKER.finditer(line):
            rank = int(m["rank"])
            if m["step"] is not None:
                step = int(m["step"])
                self.steps.append((t, rank, step))
                self.last_step[rank] = max(step, self.last_step.get(rank, 0))
            else:
                self.resumed.append((t, rank, int(m["resumed"]), int(m["attempt"])))
        for m in FINAL.finditer(line):
            self.finals.append((t, m[1], int(m[2])))
        m = AGENT_EVENT.search(line)
        if m:
            self.events.append((t, node, m[1], m[2].strip()))
        for pattern, name in TORCH_EVENTS:
            if pattern.search(line):
                self.events.append((t, node, name, line))

    def first_step_of_last_attempt(self, world: int, after: float) -> Optional[dict[int, float]]:
        """Per rank, its first step after its last ``resumed`` line later than ``after``."""
        out: dict[int, float] = {}
        for rank in range(world):
            res = [t for t, r, _, _ in self.resumed if r == rank and t >= after]
            if not res:
                return None
            t_res = max(res)
            later = [t for t, r, _ in self.steps if r == rank and t >= t_res]
            if not later:
                return None
            out[rank] = min(later)
        return out

    def event(self, name: str, after: float = 0.0, node: Optional[int] = None
              ) -> Optional[tuple[float, int, str]]:
        """The first event ``name`` at or after ``after`` (on ``node`` if given)."""
        for t, n, ev, rest in self.events:
            if ev == name and t >= after and (node is None or n == node):
                return t, n, rest
        return None


class ExitWatch:
    """Records when each of a set of processes terminates, from pidfds polled in a thread."""

    def __init__(self, procs: Mapping[int, psutil.Process]) -> None:
        """``procs``: rank -> process. Raises BenchError if one is already gone."""
        self.exited: dict[int, float] = {}
        self._fds: dict[int, int] = {}  # fd -> rank
        self.fd_of: dict[int, int] = {}  # rank -> fd
        try:
            for rank, p in procs.items():
                fd = os.pidfd_open(p.pid)
                self._fds[fd] = rank
                self.fd_of[rank] = fd
                if not p.is_running():  # the pid was recycled before the pidfd pinned it
                    raise BenchError(f"the worker of rank {rank} (pid {p.pid}) was gone already")
        except ProcessLookupError:
            self.close()
            raise BenchError("a worker exited before the fault was injected") from None
        except BenchError:
            self.close()
            raise
        self._done = threading.Event()
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="exit-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = select.poll()
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        left = set(self._fds)
        while left:
            ready = poller.poll()
            t = time.monotonic()
            for fd, _ in ready:
                if fd == self._stop_r:
                    return
                if fd in left:
                    self.exited[self._fds[fd]] = t
                    left.discard(fd)
                    poller.unregister(fd)
        self._done.set()

    def send(self, rank: int, sig: int) -> float:
        """Signal rank's process through its pidfd (never a recycled pid); the time just before."""
        t = time.monotonic()
        signal.pidfd_send_signal(self.fd_of[rank], sig)
        return t

    def wait_all(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def close(self) -> None:
        if hasattr(self, "_thread"):
            os.write(self._stop_w, b"x")
            self._thread.join(5)
            os.close(self._stop_r)
            os.close(self._stop_w)
        for fd in self._fds:
            os.close(fd)
        self._fds = {}


class Cluster:
    """Three (or N) launcher processes forming one job; ``close()`` reaps all they started."""

    def __init__(self, argvs: Sequence[Sequence[str]], *, cwd: Path, logs: Path,
                 env: Optional[Mapping[str, str]] = None) -> None:
        self.argvs = [list(a) for a in argvs]
        self.env = launcher_env(env)
        self.cwd = cwd
        self.logs = logs
        self.timeline = Timeline()
        self._cond = threading.Condition()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._readers: list[threading.Thread] = []
        self._seen: dict[int, psutil.Process] = {}
        self.started_at = 0.0
        self.tails: list[list[str]] = [[] for _ in self.argvs]

    def start(self) -> float:
        self.started_at = time.monotonic()
        self.logs.mkdir(parents=True, exist_ok=True)
        for i, argv in enumerate(self.argvs):
            p = launch(argv, self.cwd, self.env)  # its own session (_launched.py)
            self._procs.append(p)
            self._seen[p.pid] = psutil.Process(p.pid)
            th = threading.Thread(target=self._read, args=(i, p), name=f"node{i}-output",
                                  daemon=True)
            th.start()
            self._readers.append(th)
        return self.started_at

    def _read(self, node: int, proc: subprocess.Popen[bytes]) -> None:
        def line(t: float, text: str) -> None:
            tail = self.tails[node]
            tail.append(text)
            del tail[:-8]
            self.timeline.parse(node, t, text)

        def eof() -> None:
            self.timeline.eof[node] = time.monotonic()

        read_stamped(proc, self.logs / f"node{node}.log", self.started_at, self._cond, line, eof)

    def wait_for(self, pred: Callable[[Timeline], bool], timeout: float, what: str) -> None:
        """Block until ``pred(timeline)`` holds; BenchError naming ``what`` on timeout or EOF."""
        wait_until(self._cond, lambda: pred(self.timeline), lambda: len(self.timeline.eof) == len(self.argvs),
                   timeout, what, self.tail)

    def wait_exit(self, timeout: float) -> list[int]:
        """Every launcher's exit code, once all exited and their output is fully read."""
        deadline = time.monotonic() + timeout
        codes = []
        for p in self._procs:
            try:
                codes.append(p.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise BenchError(f"a launcher did not exit within {timeout:.0f}s; "
                                 f"{self.tail()}") from None
        self.wait_for(lambda tl: len(tl.eof) == len(self.argvs), 30, "end of output")
        return codes

    # -- workers --------------------------------------------------------------------------------
    def _scan(self) -> list[tuple[int, psutil.Process]]:
        return [(node, k) for node, p in enumerate(self._procs) for k in descendants(p.pid, self._seen)]

    def torch_workers(self, script: str) -> dict[int, tuple[int, psutil.Process]]:
        """rank -> (node, process) of torchrun's live workers, from their environment."""
        found: dict[int, tuple[int, psutil.Process]] = {}
        for node, p in self._scan():
            try:
                if not any(script in a for a in p.cmdline()):
                    continue
                rank = p.environ().get("RANK")
            except psutil.Error:
                continue
            if rank is not None and rank.isdigit():
                found[int(rank)] = (node, p)
        return found

    def etk_workers(self, nproc: int) -> dict[int, tuple[int, psutil.Process]]:
        """rank -> (node, process) of elastictk's current workers, from each agent's own lines."""
        kids = {p.pid: p for _, p in self._scan()}
        found: dict[int, tuple[int, psutil.Process]] = {}
        with self._cond:
            events = list(self.timeline.events)
        for node in range(len(self._procs)):
            joined = [rest for _, n, ev, rest in events if n == node and ev == "round_joined"]
            started = [rest for _, n, ev, rest in events if n == node and ev == "workers_started"]
            if not joined or not started:
                continue
            m = GROUP_RANK.search(joined[-1])
            if m is None:
                continue
            group_rank = int(m[1])
            pids = PIDS.findall(started[-1].split("pids=", 1)[-1])
            for local, pid in pids:
                p = kids.get(int(pid))
                if p is not None:
                    found[group_rank * nproc + int(local)] = (node, p)
        return found

    def close(self) -> list[int]:
        """Stop launchers that still run (SIGTERM, then SIGKILL), SIGKILL any process they
        started that is still alive; every pid this job ever saw."""
        self._scan()
        return reap(self._procs, self._readers, self._seen)

    def tail(self) -> str:
        with self._cond:
            parts = [f"node{i}: " + " | ".join(t[-4:]) for i, t in enumerate(self.tails)]
        return "last lines: " + " || ".join(parts) + f" (logs: {self.logs})"

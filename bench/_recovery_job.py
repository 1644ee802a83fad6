"""One launcher run of ``examples/train.py`` watched from outside: its output, timed line by line.

The recovery benchmark treats both launchers as black boxes, the way an operator sees them: it
starts ``torchrun`` or ``elastictk-run`` as a process, reads the job's merged stdout/stderr in a
thread that stamps every line with ``time.monotonic()`` the moment it arrives, and waits on what
the lines say (a :class:`threading.Condition` is notified per line, and at end of output).

What the lines say, as ``examples/train.py`` and the launchers write them:

- ``[rank R] step S loss ...``: rank R finished step S;
- ``[rank R] resumed at step S (attempt A)``: a restarted rank loaded the checkpoint; ``A`` is
  ``TORCHELASTIC_RESTART_COUNT``, so lines of attempt >= 1 come from after the restart, however
  late a line of the killed attempt is read;
- ``final checksum H after S steps``: the job's result, identical for every correct run;
- ``[elastictk-run] <event> k=v ...``: elastictk's agent transitions (``workers_started`` lists
  the workers' pids); torchrun's agent prints ``failed (exitcode: ...)`` and ``Sending process
  ... closing signal`` at its default log level, which are kept as events too.

Workers run with ``python -u``, which writes a line's text and its newline in two ``write``
calls, so two ranks' lines can be glued together on the shared pipe
(``[rank 0] step 20 loss 1.0[rank 1] step 20 loss 2.0``); every pattern is therefore searched
anywhere in a line, as often as it occurs.

Finding a rank's process: torchrun execs each worker with ``RANK`` in its environment, which
``/proc/<pid>/environ`` shows. elastictk forks Python workers from its preload server, and a
forked process's ``/proc/<pid>/environ`` still shows the server's environment (the block the
kernel set up at exec), so there the pid comes from the agent's own ``workers_started`` line and
is checked to be a live descendant of the launcher that is neither the preload server nor the
death watch (both of which the agent started with ``-c``/``-I``, not as a worker).
"""
from __future__ import annotations

import os
import re
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

# torchrun's agent says little at its default log level; these two lines it does print.
TORCH_MARKS = (
    TORCH_WORKER_FAILED,
    (re.compile(r"Sending process \d+ closing signal"), "torch_stopping_workers"),
)


@dataclass
class Timeline:
    """What the job's output said, and when (monotonic seconds); filled in by the reader."""

    first_step: dict[int, float] = field(default_factory=dict)  # attempt 0, per rank
    last_step: dict[int, int] = field(default_factory=dict)  # highest step seen, per rank
    resumed: dict[int, tuple[float, int, int]] = field(default_factory=dict)  # (t, step, attempt)
    step_after_resume: dict[int, tuple[float, int]] = field(default_factory=dict)  # (t, step)
    attempts: set[int] = field(default_factory=set)  # attempts seen in resumed lines
    agent: list[tuple[float, str, str]] = field(default_factory=list)  # (t, event, rest)
    final: Optional[tuple[float, str, int]] = None  # (t, checksum, steps)
    eof: Optional[float] = None

    def recovered(self, world: int) -> bool:
        """Every rank logged a step after resuming, all ranks in the same attempt."""
        if any(r not in self.step_after_resume for r in range(world)):
            return False
        return len({self.resumed[r][2] for r in range(world)}) == 1

    def agent_event(self, name: str, after: float = 0.0) -> Optional[tuple[float, str]]:
        """The first agent event ``name`` at or after ``after``: (t, the rest of its line)."""
        for t, event, rest in self.agent:
            if event == name and t >= after:
                return t, rest
        return None


def parse_line(tl: Timeline, t: float, line: str) -> None:
    """Fold one output line, read at time ``t``, into ``tl``.

    A rank's "resumed" line of a later attempt supersedes an earlier one (an attempt can resume
    and still fail before its first step), and only a step line after the rank's latest
    "resumed" line counts as its first step after the restart.
    """
    for m in WORKER.finditer(line):  # in the order the ranks wrote them
        rank = int(m["rank"])
        if m["step"] is not None:
            step = int(m["step"])
            tl.first_step.setdefault(rank, t)
            tl.last_step[rank] = max(step, tl.last_step.get(rank, 0))
            if rank in tl.resumed and rank not in tl.step_after_resume:
                tl.step_after_resume[rank] = (t, step)
        else:
            attempt = int(m["attempt"])
            tl.attempts.add(attempt)
            if attempt >= 1 and (rank not in tl.resumed or attempt > tl.resumed[rank][2]):
                tl.resumed[rank] = (t, int(m["resumed"]), attempt)
                tl.step_after_resume.pop(rank, None)
    m = FINAL.search(line)
    if m:
        tl.final = (t, m[1], int(m[2]))
    m = AGENT_EVENT.search(line)
    if m:
        tl.agent.append((t, m[1], m[2].strip()))
    for pattern, name in TORCH_MARKS:
        if pattern.search(line):
            tl.agent.append((t, name, line))


class Job:
    """A launcher process running the example job; ``close()`` reaps it and all it started."""

    def __init__(self, argv: Sequence[str], *, cwd: Path, log: Path,
                 env: Optional[Mapping[str, str]] = None) -> None:
        self.argv = list(argv)
        self.env = launcher_env(env)
        self.cwd = cwd
        self.log_path = log
        self.timeline = Timeline()
        self.lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._reader: Optional[threading.Thread] = None
        self._seen: dict[int, psutil.Process] = {}  # every descendant ever seen, for reaping
        self.started_at = 0.0

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> float:
        """Launch; the monotonic time just before the launcher was started."""
        self.started_at = time.monotonic()
        self._proc = launch(self.argv, self.cwd, self.env)  # its own session (_launched.py)
        self._seen[self._proc.pid] = psutil.Process(self._proc.pid)
        self._reader = threading.Thread(target=self._read, name="job-output", daemon=True)
        self._reader.start()
        return self.started_at

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def _read(self) -> None:
        assert self._proc is not None
        read_stamped(self._proc, self.log_path, self.started_at, self._cond, self._line, self._eof)

    def _line(self, t: float, line: str) -> None:
        self.lines.append((t, line))
        parse_line(self.timeline, t, line)

    def _eof(self) -> None:
        self.timeline.eof = time.monotonic()

    def wait_for(self, pred: Callable[[Timeline], bool], timeout: float, what: str) -> None:
        """Block until ``pred(timeline)`` holds; BenchError naming ``what`` on timeout or EOF."""
        wait_until(self._cond, lambda: pred(self.timeline), lambda: self.timeline.eof is not None, timeout,
                   what, self.tail, prefix=f"{self.name}: ")

    def wait_exit(self, timeout: float) -> int:
        """The launcher's exit code, once it exited and its output is fully read."""
        assert self._proc is not None
        try:
            code = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(f"{self.name}: did not exit within {timeout:.0f}s; {self.tail()}") \
                from None
        self.wait_for(lambda tl: tl.eof is not None, 30, "end of output")
        return code

    def returncode(self) -> Optional[int]:
        """The launcher's exit code if it has exited, else None; never blocks."""
        return None if self._proc is None else self._proc.poll()

    def close(self) -> list[int]:
        """Stop the launcher if it still runs (SIGTERM, then SIGKILL), then SIGKILL any process
        it started that is still alive; every pid this job ever saw."""
        self._scan()
        return reap([self._proc] if self._proc is not None else [], [self._reader], self._seen)

    # -- processes ------------------------------------------------------------------------------
    def _scan(self) -> list[psutil.Process]:
        return descendants(self.pid, self._seen)

    def worker(self, rank: int, world: int) -> psutil.Process:
        """The live process of ``rank`` in the current attempt (see the module docstring)."""
        kids = self._scan()
        by_env = [p for p in kids if _env_rank(p) == rank]
        if len(by_env) == 1:
            return by_env[0]
        started = [rest for _, event, rest in self.timeline.agent if event == "workers_started"]
        if started:
            pids = {int(lr): int(pid) for lr, pid in PIDS.findall(started[-1].split("pids=", 1)[-1])}
            pid = pids.get(rank)  # one node: the local rank is the rank
            match = [p for p in kids if p.pid == pid and _is_worker_like(p)]
            if len(pids) == world and len(match) == 1:
                return match[0]
        raise BenchError(f"{self.name}: cannot find the process of rank {rank} among "
                         f"{[(p.pid, _cmd(p)) for p in kids]}")

    @property
    def name(self) -> str:
        return Path(self.argv[0]).name if self.argv else "job"

    def tail(self, n: int = 6) -> str:
        with self._cond:
            last = [line for _, line in self.lines[-n:]]
        return f"last lines: {' | '.join(last) or '(none)'} (full log: {self.log_path})"


def _env_rank(p: psutil.Process) -> Optional[int]:
    try:
        rank = p.environ().get("RANK")
    except psutil.Error:
        return None
    return int(rank) if rank is not None and rank.isdigit() else None


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:80]
    except psutil.Error:
        return "?"


def _is_worker_like(p: psutil.Process) -> bool:
    """Not a helper of the agent: a forked worker is its preload server's child, and a session
    leader (``setsid``) with the server's command line."""
    try:
        return p.pid == os.getsid(p.pid) and p.parent() is not None and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OSError):
        return False

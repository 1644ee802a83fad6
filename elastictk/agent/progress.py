"""The progress watchdog: a rank that stops completing steps is hung, whatever blocks it.

Timers (``--collective-timeout``) catch a rank stuck in a Python-level ``torch.distributed``
call. A rank frozen by SIGSTOP, or blocked inside DDP's C++ all-reduce, never enters such a
call, and its peers wait in theirs until the backend's own timeout (30 minutes by default).
What every training loop does show is steps: each worker writes the monotonic time of its
latest step into its slot of the steps block (optimizer step hooks, ``elastictk.metrics.step()``,
``run_elastic``; see ``elastictk.metrics.worker``), which costs the worker a few stores.

:class:`ProgressWatch` reads those slots on one thread that sleeps until the earliest deadline
it knows of (a rank's last step + ``progress_timeout``, or a rank's start +
``startup_timeout``), so a healthy job costs one wake-up per ``progress_timeout`` (and one
every few seconds until every rank has completed its first step). Once every local rank has
completed a step, a rank without a step for ``progress_timeout`` seconds makes the group hung;
a rank with no first step within ``startup_timeout`` of its start does too. Then, in order:
every worker's stacks are dumped (faulthandler through the timer region where the process can
run the handler; ``py-spy dump`` for a stopped process or one that did not answer), the
culprit(s) are named (stopped ranks, else the fewest steps, else the oldest last step, else all
stalled ranks) apart from the ranks blocked waiting on them, the :class:`Hang` is handed to the
agent, and the culprits are SIGKILLed. The agent then sees an ordinary worker failure and
recovers as for any other (restart-all or in place); :meth:`ProgressWatch.hang_of` tells it why
the worker died.

Under ``--hang-detection learned`` (``learned=True``, elastictk-run's default) progress is any
mark a worker writes (steps, completed collectives, ``fault_point``, ``elastictk.section``; see
``elastictk/metrics/marks.py``), judged against deadlines learned from the job's own pace
(``pace.py``) by ``hangjudge.judge``: a stopped rank, or one idle outside a collective while a
peer waits in one, is hung (declared as above, trigger ``learned``); every rank due together is
a stall, reported with stacks and never killed unless ``progress_timeout`` (then the user's
explicit ceiling) is outlasted. ``learned.py`` holds what the agent learned across attempts.
What a hang is, whom it blames and its report are ``hang.py``; how a rank's stacks are taken,
``rankstacks.py``: this module is the watch, when to look and when to declare.

While any watched worker has exited, nothing is judged: the agent is stopping the group or
replacing the worker, and the next :meth:`arm`/:meth:`replace` starts the clocks again.
"""
from __future__ import annotations

import logging
import math
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

from ..lifetime.handle import ProcessHandle
from ..metrics.layout import SlotSnapshot
from ..metrics.steps import WorkerStepsBlock
from .hang import STALL_REPORT, Hang, RankState, choose_culprits, write_report
from .hangjudge import RankView, Verdict
from .learned import Learned, Stall
from .rankstacks import PYSPY_TIMEOUT, StackDumper, dump, proc_state

log = logging.getLogger("elastictk.agent")

FIRST_STEP_LOOK = 5.0  # longest sleep while waiting for every rank's first step
MAX_SLEEP = 3600.0  # a finished rank's deadline is infinite


def check_timeout(value: Optional[float], flag: str) -> Optional[float]:
    """``None`` or 0 means off; anything else must be a number of seconds > 0."""
    if value is None or value == 0:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1e9:
        raise ValueError(f"{flag} {value!r} must be a number of seconds > 0 (0 turns it off)")
    return float(value)


@dataclass
class _Rank:
    rank: int
    handle: ProcessHandle
    started: float  # time.monotonic() when watched
    baseline: int  # the slot's step count then


class ProgressWatch:
    """Judges one node's workers by their steps; see the module docstring."""

    def __init__(self, block: WorkerStepsBlock, *, progress_timeout: Optional[float],
                 startup_timeout: Optional[float], stacks: Optional[StackDumper] = None,
                 on_hang: Optional[Callable[[Optional[Hang]], None]] = None,
                 learned: bool = False) -> None:
        self.block = block
        self.progress_timeout = check_timeout(progress_timeout, "--progress-timeout")
        self.startup_timeout = check_timeout(startup_timeout, "--startup-timeout")
        # --hang-detection learned: progress of any kind judged against learned deadlines
        # (learned.py); progress_timeout is then the user's explicit ceiling, or None
        self.learned = Learned(self.progress_timeout) if learned else None
        self._stacks, self._on_hang = stacks, on_hang
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._ranks: dict[int, _Rank] = {}
        self._report_dir: Optional[Path] = None
        self._fired = False
        self._closed = False
        self._by_pid: dict[int, Hang] = {}
        self._unseen: list[Hang] = []
        self._thread = threading.Thread(target=self._run, name="elastictk-progress", daemon=True)
        self._thread.start()

    # -- the agent's calls -------------------------------------------------------------------
    def arm(self, pids: Mapping[int, int], ranks: Mapping[int, int], report_dir: object) -> None:
        """Watch a freshly started attempt; every clock starts now."""
        with self._lock:
            self._drop_all()
            self._by_pid.clear()
            self._unseen.clear()
            self._fired = False
            self._report_dir = Path(str(report_dir)) if report_dir is not None else None
            slots = self._slots()
            now = time.monotonic()
            for lr, pid in pids.items():
                self._add(lr, pid, ranks.get(lr, lr), now, slots)
        self._wake.set()

    def replace(self, local_rank: int, pid: int, rank: int) -> None:
        """A replacement (in place) runs in ``local_rank``: its startup clock starts now, and
        the others' steps are counted afresh (they wait for it to re-form)."""
        with self._lock:
            slots = self._slots()
            now = time.monotonic()
            old = self._ranks.pop(local_rank, None)
            if old is not None:
                old.handle.close()
            self._add(local_rank, pid, rank, now, slots)
            for lr, r in self._ranks.items():
                r.baseline = slots[lr].steps if lr < len(slots) else 0
            self._fired = False
        self._wake.set()

    def forget(self, local_rank: int) -> None:
        """The worker of ``local_rank`` exited; judging waits for its replacement."""
        with self._lock:
            r = self._ranks.pop(local_rank, None)
            if r is not None:
                r.handle.close()
            self._fired = True  # until replace() or arm()

    def pause(self) -> None:
        """Judge nothing until the next :meth:`arm` or :meth:`replace`."""
        with self._lock:
            self._fired = True

    def take_new(self) -> list[Hang]:
        with self._lock:
            out, self._unseen = self._unseen, []
        return out

    def blame_stopped(self, failed: list[int]) -> Optional[Hang]:
        """Workers ``failed`` (PIDs) on their own — most often a collective's backend timeout —
        while a sibling sits stopped (state T): the stopped rank froze the collective and is the
        culprit, whatever the failed worker's error says. Declared as a ``stopped_peer`` hang
        (stacks dumped, the stopped rank named and killed) that the failed workers map to too,
        so the failure is reported as the hang it was."""
        with self._lock:
            if self._closed or not self._ranks or any(p in self._by_pid for p in failed):
                return None
            ranks = dict(self._ranks)
            stopped = [lr for lr, r in ranks.items()
                       if r.handle.pid not in failed and proc_state(r.handle.pid) in ("T", "t")]
            if not stopped:
                return None
            self._fired = True
            slots = self._slots()
            last = {lr: slots[lr].last_step_mono if lr < len(slots) else 0.0 for lr in ranks}
            stepped = {lr: last[lr] > r.started for lr, r in ranks.items()}
            report_dir = self._report_dir
        self._declare("stopped_peer", self.progress_timeout or 0.0, stopped, ranks, slots, last,
                      stepped, report_dir)
        with self._lock:
            hang = self._by_pid.get(ranks[stopped[0]].handle.pid)
            if hang is not None:
                for p in failed:
                    self._by_pid[p] = hang
        return hang

    def hang_of(self, pid: int) -> Optional[Hang]:
        """The hang a worker was killed for in the current attempt, if it was."""
        with self._lock:
            return self._by_pid.get(pid)

    def killed(self) -> dict[int, Hang]:
        """PID -> hang of every worker killed in the current attempt."""
        with self._lock:
            return dict(self._by_pid)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop_all()
        self._wake.set()
        self._thread.join(timeout=PYSPY_TIMEOUT + 5)

    # -- inside -------------------------------------------------------------------------------
    def _add(self, lr: int, pid: int, rank: int, now: float, slots: list[SlotSnapshot]) -> None:
        try:
            handle = ProcessHandle(pid)
        except (ValueError, OSError):
            return  # already gone: the agent sees its exit
        self._ranks[lr] = _Rank(rank, handle, now, slots[lr].steps if lr < len(slots) else 0)

    def _drop_all(self) -> None:
        for r in self._ranks.values():
            r.handle.close()
        self._ranks.clear()

    def _slots(self) -> list[SlotSnapshot]:
        return self.block.snapshot()

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
            try:
                wait = self._check()
            except Exception:  # noqa: BLE001 - the watchdog must outlive one bad look
                log.exception("progress check failed")
                wait = 5.0
            self._wake.wait(wait)
            self._wake.clear()

    def _check(self) -> Optional[float]:
        """One look; the seconds until the next deadline (None: nothing to wait for)."""
        with self._lock:
            if self._fired or self._closed or not self._ranks:
                return None
            if any(r.handle.exited() for r in self._ranks.values()):
                return None  # the agent is stopping or replacing: it re-arms
            slots = self._slots()
            if not slots:
                return None
            now = time.monotonic()
            last = {lr: slots[lr].last_step_mono for lr in self._ranks}
            stepped = {lr: last[lr] > r.started for lr, r in self._ranks.items()}
            deadlines: dict[int, float] = {}
            if self.learned is not None:
                return self._look_learned(now, slots)
            if all(stepped.values()):
                kind, timeout = "progress", self.progress_timeout
                if timeout is not None:
                    since = max(r.started for r in self._ranks.values())
                    deadlines = {lr: max(last[lr], since) + timeout for lr in self._ranks}
            else:
                kind, timeout = "startup", self.startup_timeout
                if timeout is not None:
                    deadlines = {lr: r.started + timeout for lr, r in self._ranks.items()
                                 if not stepped[lr]}
            # Before every rank has stepped nothing tells this thread when one does: it looks
            # again within half the progress timeout (at most FIRST_STEP_LOOK), which is soon
            # enough for the first progress deadline (counted from the step, not the look).
            first = (min(self.progress_timeout / 2, FIRST_STEP_LOOK)
                     if kind == "startup" and self.progress_timeout is not None else None)
            if not deadlines or timeout is None:
                return first
            due = [lr for lr, d in deadlines.items() if d <= now]
            if not due:
                wait = min(MAX_SLEEP, max(0.01, min(deadlines.values()) - now + 0.01))
                return wait if first is None else min(wait, first)
            self._fired = True
            ranks = dict(self._ranks)
            report_dir = self._report_dir
        self._declare(kind, timeout, due, ranks, slots, last, stepped, report_dir)
        return None

    def _look_learned(self, now: float, slots: list[SlotSnapshot]) -> Optional[float]:
        """One look of the learned judge (hangjudge.py), called holding the lock; it is
        released to dump stacks and kill."""
        assert self.learned is not None
        ranks = dict(self._ranks)
        # a replacement (in place) restarts every clock: the others wait for it to re-form
        since = max(r.started for r in ranks.values())
        verdict, wait, views = self.learned.look(
            now, {lr: (r.rank, r.handle.pid, since) for lr, r in ranks.items()}, slots)
        startup = self._startup_wait(now, slots)
        if startup is not None and (verdict is None or startup[0] is not None):
            if startup[0] is not None:
                due, timeout = startup[0], self.startup_timeout or 0.0
                self._fired = True
                self._unlocked_declare("startup", timeout, due, ranks, slots, now)
                return None
            wait = min(wait, startup[1])
        if verdict is None:
            return wait
        last = {v.local_rank: v.last for v in views}
        if verdict.kind == "hung":
            self._fired = True
            self._unlocked_declare("learned", verdict.deadline, list(verdict.local_ranks),
                                   ranks, slots, now, (list(verdict.local_ranks), verdict.reason), last)
            return None
        idle = now - max(last.values())
        explicit = self.progress_timeout
        if explicit is not None and idle >= explicit:
            self._fired = True
            self._unlocked_declare("progress", explicit, list(verdict.local_ranks), ranks,
                                   slots, now, None, last)
            return None
        if self.learned.stalled_since is None:
            self.learned.stalled_since = max(last.values())
            report_dir = self._report_dir
            self._lock.release()
            try:
                self._report_stall(verdict, views, ranks, report_dir, idle)
            finally:
                self._lock.acquire()
        return wait if explicit is None else min(wait, max(0.01, explicit - idle + 0.01))

    def _startup_wait(self, now: float, slots: list[SlotSnapshot]) -> Optional[tuple[Optional[list[int]], float]]:
        """``--startup-timeout`` in learned mode: (ranks due, or None; seconds to the next)."""
        if self.startup_timeout is None:
            return None
        pending = {lr: r.started + self.startup_timeout for lr, r in self._ranks.items()
                   if not (lr < len(slots) and slots[lr].last_step_mono > r.started)}
        if not pending:
            return None
        due = [lr for lr, d in pending.items() if d <= now]
        return (due or None), max(0.01, min(pending.values()) - now + 0.01)

    def _unlocked_declare(self, kind: str, timeout: float, due: list[int], ranks: dict[int, _Rank],
                          slots: list[SlotSnapshot], now: float,
                          chosen: Optional[tuple[list[int], str]] = None,
                          last: Optional[dict[int, float]] = None) -> None:
        if last is None:
            last = {lr: (slots[lr].last_step_mono if lr < len(slots) else 0.0) for lr in ranks}
        stepped = {lr: last[lr] > r.started for lr, r in ranks.items()}
        report_dir = self._report_dir
        self._lock.release()
        try:
            self._declare(kind, timeout, due, ranks, slots, last, stepped, report_dir, chosen)
        finally:
            self._lock.acquire()

    def _report_stall(self, verdict: Verdict, views: list[RankView], ranks: dict[int, _Rank],
                      report_dir: Optional[Path], idle: float) -> None:
        """All ranks stalled together: stacks dumped and written, one line, an event; no kill."""
        assert self.learned is not None
        states = {lr: proc_state(r.handle.pid) for lr, r in ranks.items()}
        dumps = dump({lr: r.handle.pid for lr, r in ranks.items()}, states, self._stacks)
        now = time.monotonic()
        infos = {v.local_rank: RankState(v.local_rank, v.rank, ranks[v.local_rank].handle.pid, 0,
                                         now - v.last, states[v.local_rank], dumps[v.local_rank][2],
                                         dumps[v.local_rank][0], dumps[v.local_rank][1])
                 for v in views if v.local_rank in ranks}
        path = write_report(report_dir, "stalled", verdict.deadline, infos, [], STALL_REPORT)
        lrs = [lr for lr in verdict.local_ranks if lr in infos]
        stall = Stall(tuple(lrs), tuple(infos[lr].rank for lr in lrs), idle, verdict.deadline,
                      verdict.reason, tuple(infos[lr].where for lr in lrs), path, False)
        log.warning("%s", stall.line(socket.gethostname()))
        self.learned.add_stall(stall)
        if self._on_hang is not None:
            try:
                self._on_hang(None)
            except Exception:  # noqa: BLE001 - a wake-up only
                log.exception("on_hang callback failed")

    def _declare(self, kind: str, timeout: float, due: list[int], ranks: dict[int, _Rank],
                 slots: list[SlotSnapshot], last: dict[int, float], stepped: dict[int, bool],
                 report_dir: Optional[Path], chosen: Optional[tuple[list[int], str]] = None) -> None:
        now = time.monotonic()
        states = {lr: proc_state(r.handle.pid) for lr, r in ranks.items()}
        steps = {lr: slots[lr].steps - r.baseline for lr, r in ranks.items()}
        idle = {lr: 0.0 if last[lr] == math.inf else now - (last[lr] if stepped[lr] else r.started)
                for lr, r in ranks.items()}  # inf: the rank's script has ended (not judged)
        culprits, reason = chosen if chosen is not None else \
            choose_culprits(kind, due, states, steps, idle, stepped)
        dumps = dump({lr: r.handle.pid for lr, r in ranks.items()}, states, self._stacks)
        infos = {lr: RankState(lr, r.rank, r.handle.pid, steps[lr], idle[lr], states[lr],
                               dumps[lr][2], dumps[lr][0], dumps[lr][1])
                 for lr, r in ranks.items()}
        path = write_report(report_dir, kind, timeout, infos, culprits)
        hang = Hang(kind, timeout, tuple(infos[lr] for lr in culprits),
                    tuple(infos[lr] for lr in sorted(ranks) if lr not in culprits), reason,
                    socket.gethostname(), path, declared_at=now)
        with self._lock:
            for c in hang.culprits:
                self._by_pid[c.pid] = hang
            self._unseen.append(hang)
        log.warning("%s", hang.describe())
        if self._on_hang is not None:
            try:
                self._on_hang(hang)
            except Exception:  # noqa: BLE001 - the kill below must happen regardless
                log.exception("on_hang callback failed")
        for lr in culprits:
            ranks[lr].handle.send(signal.SIGKILL)

def worker_env(enabled: bool) -> dict[str, str]:
    """What workers need for the progress watchdog beyond the steps block's own variables:
    the timer region attached at start, so a running worker can dump its stacks on request."""
    return {"ELASTICTK_PROGRESS_STACKS": "1"} if enabled else {}


__all__ = ["ProgressWatch", "check_timeout", "worker_env"]

"""The agent's side of the timers: scan the workers' regions, reap a worker whose timer expired.

How an agent uses it (one server per worker group, for the agent's whole life)::

    server = TimerServer(spec.local_world_size, on_expiry=lambda e: group.wake())
    spec = replace(spec, env={**spec.env, **server.worker_env(collective_timeout=300)})
    group = WorkerGroup(spec, log_dir)
    ...                                      # every attempt:
    group.start(attempt, assignment)
    server.watch(group.pids(), ranks={lr: assignment.global_rank(lr) for lr in group.pids()},
                 report_dir=group.attempt_dir)
    ...                                      # a failed worker? server.expiries() says if it hung
    group.stop()
    server.unwatch()
    ...
    server.close()

Reaping, in order: see a deadline pass (the reaper sleeps until the earliest deadline it knows
of, at most ``scan_interval``, and a worker arming a timer due sooner wakes it: see
``layout``), read the word again to be sure, check that the process is still the one
registered (pidfd + start time), send the dump signal (plus SIGCONT if the worker is stopped,
so it can run the handler), wait until the dump stops growing (at most ``dump_timeout``), write
the hang report, hand the :class:`Expiry` to the agent, then SIGKILL. Several workers expiring
together are dumped together. A worker is reaped at most once per ``watch``.

The hot path stays free: a worker tells the agent about a timer only when it is due before the
agent's next planned look, which for the timers a job holds (collectives of seconds or minutes)
is rare; an idle job's reaper wakes once per ``scan_interval``. A scan of an idle region is one
comparison of 960 bytes against zeros.
"""
from __future__ import annotations

import logging
import mmap
import os
import signal
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

from . import layout as L
from .boot import worker_env
from .expiry import Expiry, report_file, write_report
from ..lifetime.handle import ProcessHandle
from ..lifetime.procfs import in_tree
from .dumps import Dump, await_dumps, open_stacks, read_dump, signal_dump
from .stacks import culprit, parse
from ..lifetime.ready import readable

log = logging.getLogger("elastictk.timer")

# A scan reads the first _HEAD slots (where a worker's timers cluster: the free list hands out
# the lowest slot first) and checks the rest against zeros, decoding it only when in use.
_HEAD = 8
_HEAD_ARRAY = struct.Struct(f"@{_HEAD}Q")
_ZERO_SLOTS = bytes(L.TABLE_OFFSET - L.SLOTS_OFFSET)
_ZERO_TAIL = bytes(L.TABLE_OFFSET - L.SLOTS_OFFSET - 8 * _HEAD)


@dataclass
class _Worker:
    local_rank: int
    rank: int
    handle: ProcessHandle
    report_dir: Optional[Path]
    owner: Optional[ProcessHandle] = None  # a descendant that claimed the region, if not the worker
    refused_owner: int = 0  # an owner PID outside the worker's tree (warned about once)
    done: bool = False  # reaped or dropped: not scanned again until the next watch


@dataclass
class _Victim:
    worker: _Worker
    expired: list[tuple[int, int]]  # (scope id, deadline ns), earliest first
    armed: list[tuple[int, int]]
    names: list[str]
    main_thread: int
    dump: Dump


class TimerServer:
    """Watches the timer regions of one worker group's ``local_world_size`` workers.

    ``on_expiry`` is called on the server's thread with each :class:`Expiry`, after the report
    is written and before the worker is killed; keep it quick (``group.wake`` is ideal). The
    same expiries queue up for :meth:`expiries`.
    """

    def __init__(
        self,
        local_world_size: int,
        *,
        on_expiry: Optional[Callable[[Expiry], None]] = None,
        scan_interval: float = 1.0,
        dump_timeout: float = 1.0,
        dump_quiet: float = 0.02,
        dump_signal: int = L.DEFAULT_DUMP_SIGNAL,
    ) -> None:
        if not isinstance(local_world_size, int) or local_world_size < 1:
            raise ValueError(f"local_world_size must be an integer >= 1, got {local_world_size!r}")
        if not 0 < scan_interval <= 10:
            raise ValueError(f"scan_interval {scan_interval!r} must be in (0, 10] seconds")
        if dump_timeout < 0 or dump_quiet < 0:
            raise ValueError("dump_timeout and dump_quiet must be >= 0 seconds")
        if dump_signal not in signal.valid_signals():
            raise ValueError(f"dump_signal {dump_signal!r} is not a signal number")
        if dump_signal in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError("the dump signal cannot be SIGKILL or SIGSTOP (no handler can run)")
        self.local_world_size = local_world_size
        self.scan_interval = scan_interval
        self.dump_timeout = dump_timeout
        self.dump_quiet = dump_quiet
        self.dump_signal = int(dump_signal)
        self._on_expiry = on_expiry
        # Workers write a byte here when they arm a timer due before the next planned scan.
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._fd = os.memfd_create("elastictk-timer", os.MFD_CLOEXEC)
        size = local_world_size * L.REGION_SIZE
        os.ftruncate(self._fd, size)
        self._mmap = mmap.mmap(self._fd, size)
        self._buf = memoryview(self._mmap)
        for lr in range(local_world_size):
            L.init_region(self._buf, lr * L.REGION_SIZE, self.dump_signal, self._wake_w)
        #: What workers open; valid while this server (and so this process) lives.
        self.path = f"/proc/{os.getpid()}/fd/{self._fd}"
        self._lock = threading.RLock()
        self._workers: dict[int, _Worker] = {}
        self._queue: list[Expiry] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self.stats = {"scans": 0, "expired": 0, "killed": 0, "dropped_exited": 0,
                      "dropped_stale": 0, "refused_owner": 0}

    # -- the agent's calls -----------------------------------------------------------------
    def worker_env(self, *, collective_timeout: Optional[float] = None,
                   base_env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """Variables to add to every worker's environment (``WorkerSpec.env``)."""
        return worker_env(self.path, collective_timeout=collective_timeout, base_env=base_env)

    def start(self) -> None:
        """Start the reaper thread (``watch`` does it too). Idempotent."""
        self._check_open()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elastictk-timer-reaper",
                                            daemon=True)
            self._thread.start()

    def watch(self, pids: Mapping[int, int], *, ranks: Optional[Mapping[int, int]] = None,
              report_dir: str | Path | None = None) -> None:
        """Watch the workers of an attempt: local rank -> PID (``group.pids()``), their global
        ranks (default: the local rank), and where hang reports go (the attempt's log dir)."""
        for lr, pid in pids.items():
            self.watch_worker(lr, pid, rank=(ranks or {}).get(lr, lr), report_dir=report_dir)

    def watch_worker(self, local_rank: int, pid: int, *, rank: Optional[int] = None,
                     start_time: Optional[int] = None,
                     report_dir: str | Path | None = None) -> None:
        """Watch one worker. ``start_time`` (``/proc`` clock ticks) pins the process; by default
        it is read now, which is right while the agent has not reaped the worker yet."""
        self._check_open()
        if not 0 <= local_rank < self.local_world_size:
            raise ValueError(f"local rank {local_rank} is outside 0..{self.local_world_size - 1}")
        handle = ProcessHandle(pid, start_time)
        with self._lock:
            old = self._workers.pop(local_rank, None)
            if old is not None:
                self._close_worker(old)
            self._workers[local_rank] = _Worker(
                local_rank, local_rank if rank is None else rank, handle,
                Path(report_dir) / str(local_rank) if report_dir is not None else None)
        self.start()

    def unwatch(self, local_rank: Optional[int] = None) -> None:
        """Forget the attempt's workers and clear their regions; call after ``group.stop()``
        (no worker may still be writing) and before the next ``start``. With ``local_rank``,
        only that one, once its worker has exited: a replacement started in its place (in-place
        recovery) must not inherit the timers the dead one held."""
        with self._lock:
            ranks = range(self.local_world_size) if local_rank is None else [local_rank]
            for lr in ranks:
                w = self._workers.pop(lr, None)
                if w is not None:
                    self._close_worker(w)
                L.init_region(self._buf, lr * L.REGION_SIZE, self.dump_signal, self._wake_w)
        self._wake()

    def dump_stacks(self, local_ranks: Optional[list[int]] = None) -> dict[int, tuple[int, str, str]]:
        """Dump the stacks of running workers without killing them (the progress watchdog's
        first look): local rank -> (pid, dump text, note). A worker whose timers are not
        attached (no handler for the dump signal), or that is stopped or gone, gets no signal
        and an empty text with a note saying why; so does one that did not dump within
        ``dump_timeout``. Several workers are dumped together."""
        out: dict[int, tuple[int, str, str]] = {}
        with self._lock:
            if self._closed:
                return out
            dumps: dict[int, Dump] = {}
            for lr in sorted(self._workers) if local_ranks is None else local_ranks:
                w = self._workers.get(lr)
                if w is None:
                    continue
                _, owner, stacks_fd, thread, names = self._region(w)
                if not owner or not stacks_fd:
                    out[lr] = (w.handle.pid, "", "no stack dump handler (its timers never attached)")
                    continue
                target = self._target(w, owner)
                if target is None or target.exited() or target.state() in ("T", "t", None):
                    out[lr] = (w.handle.pid, "", "stopped or gone: cannot run a signal handler")
                    continue
                d = open_stacks(target, stacks_fd)
                if d.stacks_fd is None:
                    out[lr] = (target.pid, "", d.note)
                    continue
                signal_dump(d, self.dump_signal)
                dumps[lr] = d
            await_dumps(list(dumps.values()), self.dump_signal, self.dump_timeout, self.dump_quiet)
            for lr, d in dumps.items():
                out[lr] = (d.target.pid, read_dump(d), d.note)
        return out

    def expiries(self) -> list[Expiry]:
        """The expiries since the last call (oldest first)."""
        with self._lock:
            out, self._queue = self._queue, []
        return out

    def close(self) -> None:
        """Stop the thread and free the regions. Idempotent."""
        if self._closed:
            return
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=self.dump_timeout + 5)
        with self._lock:
            self._closed = True
            for w in self._workers.values():
                self._close_worker(w)
            self._workers.clear()
            self._buf.release()
            self._mmap.close()
            os.close(self._fd)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __enter__(self) -> "TimerServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the timer server is closed; create a new one")

    @staticmethod
    def _close_worker(w: _Worker) -> None:
        w.handle.close()
        if w.owner is not None:
            w.owner.close()

    # -- scanning --------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # full (a wake-up is pending anyway) or closed
            pass

    def _run(self) -> None:
        wait = 0.0
        while True:
            ready = readable([self._wake_r], wait)
            if self._stop.is_set():
                return
            if ready:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            try:
                wait = self._scan()
            except Exception:  # noqa: BLE001 - the reaper must outlive one bad scan
                log.exception("timer scan failed")
                wait = self.scan_interval

    def _scan(self) -> float:
        """One pass; the seconds until the next is due (sooner if a deadline is near)."""
        with self._lock:
            if self._closed:
                return self.scan_interval
            self.stats["scans"] += 1
            now = time.monotonic_ns()
            # The promise first, then the look: a timer armed after this store compares its
            # deadline with it (and wakes us if sooner); one armed before is seen by the scan.
            promised = now + int(self.scan_interval * 1e9)
            self._promise(promised)
            due, soonest = [], None
            for w in self._workers.values():
                if w.done:
                    continue
                slots = w.local_rank * L.REGION_SIZE + L.SLOTS_OFFSET
                words = _HEAD_ARRAY.unpack_from(self._mmap, slots)
                if self._mmap[slots + 8 * _HEAD:slots + len(_ZERO_SLOTS)] != _ZERO_TAIL:
                    words = L.SLOT_ARRAY.unpack_from(self._mmap, slots)
                earliest = min((x & L.DEADLINE_MASK for x in words if x), default=None)
                if earliest is None:
                    continue
                if earliest <= now:
                    due.append(w)
                elif soonest is None or earliest < soonest:
                    soonest = earliest
            if due:
                self._reap(due, now)
        if soonest is None:
            return self.scan_interval
        with self._lock:
            if not self._closed and soonest < promised:
                self._promise(soonest)
        return min(self.scan_interval, max(0.0005, (soonest - time.monotonic_ns()) / 1e9))

    def _promise(self, next_scan_ns: int) -> None:
        """Tell every region when the reaper looks next (see ``layout``); under the lock."""
        for lr in range(self.local_world_size):
            L.U64.pack_into(self._buf, lr * L.REGION_SIZE + L.OFF_NEXT_SCAN, next_scan_ns)

    def _region(self, w: _Worker) -> tuple[int, int, int, int, list[str]]:
        """Header fields of a worker's region: owner, stacks fd, main thread, table names."""
        base = w.local_rank * L.REGION_SIZE
        (_, _, _, _, stacks_fd, owner, thread, table_len) = L.HEADER.unpack_from(self._buf, base)
        table_len = min(table_len, L.TABLE_SIZE)
        start = base + L.TABLE_OFFSET
        names = L.decode_table(bytes(self._buf[start:start + table_len]))
        return base, owner, stacks_fd, thread, names

    def _target(self, w: _Worker, owner: int) -> Optional[ProcessHandle]:
        """The process to dump and kill: the worker, or the descendant that owns its region."""
        if owner == w.handle.pid:
            return w.handle
        if w.owner is not None and w.owner.pid == owner:
            return w.owner
        if owner and owner != os.getpid() and in_tree(owner, w.handle.pid):
            try:
                w.owner = ProcessHandle(owner)
                return w.owner
            except ValueError:
                pass
        if w.refused_owner != owner:
            w.refused_owner = owner
            self.stats["refused_owner"] += 1
            log.warning("timer region of local rank %d is owned by pid %d, which is not worker "
                        "pid %d or one of its descendants; its timers are ignored",
                        w.local_rank, owner, w.handle.pid)
        return None

    def _reap(self, due: list[_Worker], now: int) -> None:
        victims: list[_Victim] = []
        for w in due:
            base, owner, stacks_fd, thread, names = self._region(w)
            target = self._target(w, owner)
            if target is None:
                continue
            first = L.SLOT_ARRAY.unpack_from(self._buf, base + L.SLOTS_OFFSET)
            again = L.SLOT_ARRAY.unpack_from(self._buf, base + L.SLOTS_OFFSET)
            armed = []  # (scope id, deadline ns) of words read the same twice
            for x, y in zip(first, again):
                if x and x == y:
                    deadline, sid = L.decode(x)
                    armed.append((sid, deadline))
            armed.sort(key=lambda e: e[1])
            expired = [(sid, d) for sid, d in armed if d <= now]
            if not expired:
                continue  # released (or re-armed) just now
            if target.exited():
                self.stats["dropped_exited"] += 1
                log.info("dropping expired timers of local rank %d: pid %d has exited",
                         w.local_rank, target.pid)
                w.done = True
                continue
            if not target.same_process():
                self.stats["dropped_stale"] += 1
                log.warning("not reaping local rank %d: pid %d is no longer the process that "
                            "was registered (start time changed)", w.local_rank, target.pid)
                w.done = True
                continue
            victims.append(_Victim(w, expired, armed, names, thread, open_stacks(target, stacks_fd)))
        if not victims:
            return
        for v in victims:
            v.worker.done = True
            if v.dump.stacks_fd is not None:
                signal_dump(v.dump, self.dump_signal, resume=True)
        await_dumps([v.dump for v in victims], self.dump_signal, self.dump_timeout, self.dump_quiet)
        for v in victims:
            self._finish(v, now)

    def _finish(self, v: _Victim, now: int) -> None:
        w, d = v.worker, v.dump
        text = read_dump(d)
        sid, deadline = v.expired[0]
        scope = _name(v.names, sid)
        _, frame = culprit(parse(text), scope, v.main_thread)
        expiry = Expiry(
            local_rank=w.local_rank, rank=w.rank, pid=d.target.pid, scope=scope,
            deadline=deadline / 1e9, detected_at=now / 1e9, wall_time=time.time(),
            where=frame.short() if frame is not None else None, stacks=text,
            stacks_note=d.note or ("" if text.strip() else "the stack dump was empty"),
            held=tuple((_name(v.names, s), (now - d) / 1e9) for s, d in v.armed),
            report_path=str(report_file(w.report_dir)) if w.report_dir is not None else None,
        )
        # The agent learns why before it sees the exit; the files follow the kill, which
        # should not wait for a disk.
        self.stats["expired"] += 1
        self._queue.append(expiry)
        if self._on_expiry is not None:
            try:
                self._on_expiry(expiry)
            except Exception:  # noqa: BLE001 - the kill below must happen regardless
                log.exception("on_expiry callback failed")
        if d.target.send(signal.SIGKILL):
            self.stats["killed"] += 1
        if w.report_dir is not None:
            try:
                write_report(expiry, w.report_dir)
            except OSError as e:
                log.warning("cannot write the hang report of rank %d to %s: %s", w.rank,
                            w.report_dir, e)
        log.warning("%s", expiry.describe())


def _name(names: list[str], sid: int) -> str:
    if sid < len(names):
        return names[sid]
    return "an unnamed scope" if sid == L.UNKNOWN_SCOPE else f"scope #{sid}"

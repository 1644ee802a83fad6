"""Watchdog timers: what a timer costs the worker, and how soon an expired one is reaped.

A collective timeout wraps every collective of every training step, so its acquire+release pair
is paid thousands of times a second; and the point of a timer is to end a hang soon after its
deadline. Two measurements, elastictk against torch's ``torch.distributed.elastic.timer``
(same run, interleaved samples):

- **cost**: ns per acquire+release pair, in the process that holds the timers, with the server
  ("agent") in another process as in a real job: elastictk's ``expires`` against torch's
  ``LocalTimerClient`` (multiprocessing queue to a ``LocalTimerServer``) and ``FileTimerClient``
  (JSON lines through a FIFO to a ``FileTimerServer``), both as the context manager users write
  (``with expires(after=..., scope=...)``) and as explicit acquire/release calls. torch's
  ``FileTimerClient`` raises ``BlockingIOError`` once the FIFO is full (its server reads it only
  every second); those failed calls are counted, not hidden.
- **latency**: ms from a timer's deadline until the stuck worker is dead (its pidfd readable).
  A sample starts a fresh "agent" process hosting the server, which forks a worker (with torch
  loaded, like a real one) that takes a timer and sleeps past it. elastictk's server dumps the
  worker's stacks before the SIGKILL, so its number includes that. torch's servers are run at
  their default check intervals (``LocalTimerServer`` 60 s, ``FileTimerServer`` 10 s; fewer
  samples, they are long) and at 0.1 s. Timer lengths vary per round (seeded), so no server's
  check period can line up with the deadlines.
"""
from __future__ import annotations

import os
import random
import select
import signal
import statistics
import time
from typing import Any, Callable

from ._timer_procs import (await_reader, fork_helper, kill_helper, read_line, serve_etk, serve_file,
                          serve_local)
from .common import BenchError, BenchResult, Comparison, Measured, RunConfig, interleaved

TITLE = "Watchdog timers: acquire+release cost and deadline-to-kill latency, elastictk vs torch"
LONG = 3600.0  # the cost loops' timers never expire
DEFAULT_ROUNDS = 3  # samples of torch's default intervals (a minute each for LocalTimerServer)


# -- cost ---------------------------------------------------------------------------------------
def _loops(local_client: Any, file_client: Any) -> dict[str, Callable[[int], int]]:
    """One loop per subject, written identically; each returns how many pairs failed."""
    from torch.distributed.elastic.timer import expires as torch_expires

    from elastictk.timer import acquire, expires, release

    def etk_with(n: int) -> int:
        failed = 0
        for _ in range(n):
            try:
                with expires(after=LONG, scope="bench"):
                    pass
            except OSError:
                failed += 1
        return failed

    def etk_calls(n: int) -> int:
        failed = 0
        for _ in range(n):
            try:
                release(acquire(LONG, "bench"))
            except OSError:
                failed += 1
        return failed

    def torch_with(client: Any) -> Callable[[int], int]:
        def loop(n: int) -> int:
            failed = 0
            for _ in range(n):
                try:
                    with torch_expires(after=LONG, scope="bench", client=client):
                        pass
                except OSError:
                    failed += 1
            return failed
        return loop

    def torch_calls(client: Any) -> Callable[[int], int]:
        def loop(n: int) -> int:
            failed = 0
            for _ in range(n):
                try:
                    client.acquire("bench", time.time() + LONG)
                    client.release("bench")
                except OSError:
                    failed += 1
            return failed
        return loop

    return {
        "etk-with": etk_with, "etk-calls": etk_calls,
        "local-with": torch_with(local_client), "local-calls": torch_calls(local_client),
        "file-with": torch_with(file_client), "file-calls": torch_calls(file_client),
    }


def _cost(cfg: RunConfig, tmp: str, pids: list[int]) -> list[Comparison]:
    import multiprocessing as mp

    from torch.distributed.elastic.timer import FileTimerClient, LocalTimerClient

    from elastictk import timer

    queue = mp.get_context("fork").Queue()
    helpers = []
    try:
        me = os.getpid()
        pid, r = fork_helper(lambda w: serve_etk(w, me))
        helpers.append(pid)
        timer.detach()
        timer.attach(read_line(r, 60), 0)
        os.close(r)
        fifo = os.path.join(tmp, "torch-timer.fifo")
        for body in (serve_local(queue), serve_file(fifo, 10)):
            pid, r = fork_helper(body)
            helpers.append(pid)
            read_line(r, 60)
            os.close(r)
        await_reader(fifo)
        pids.extend(helpers)
        loops = _loops(LocalTimerClient(queue), FileTimerClient(fifo))
        n = {}
        for name, loop in loops.items():  # calibrate: a sample should last about sample_seconds
            t = time.perf_counter()
            loop(200)
            per = max((time.perf_counter() - t) / 200, 1e-8)
            n[name] = max(200, int(cfg.sample_seconds / per))
        failed = {name: 0 for name in loops}
        calls = {name: 0 for name in loops}

        def sample(name: str) -> float:
            t = time.perf_counter()
            failed[name] += loops[name](n[name])
            calls[name] += n[name]
            return (time.perf_counter() - t) / n[name] * 1e9

        cfg.log(f"timer cost: {', '.join(f'{k}×{v}' for k, v in n.items())} pairs per sample")
        samples = interleaved(list(loops), sample, cfg.rounds)
    finally:
        timer.detach()
        for pid in helpers:
            kill_helper(pid)
        queue.close()
        queue.cancel_join_thread()  # its reader is gone: never wait for the feeder to flush
    extra = {name: {"pairs": calls[name], "failed_pairs": failed[name]} for name in loops}
    if failed["etk-with"] or failed["etk-calls"]:
        raise BenchError(f"elastictk timer calls failed: {extra}")
    ours = {"with": Measured("expires (with)", samples["etk-with"], extra["etk-with"]),
            "calls": Measured("acquire/release", samples["etk-calls"], extra["etk-calls"])}
    rows = []
    for form in ("with", "calls"):
        for ref, label in (("local", "LocalTimerClient"), ("file", "FileTimerClient")):
            key = f"{ref}-{form}"
            note = ""
            if failed[key]:
                note = (f"torch's FileTimerClient failed (BlockingIOError: FIFO full) in "
                        f"{failed[key]:,} of {calls[key]:,} pairs; failed pairs are timed too")
            rows.append(Comparison(
                {"measure": "cost", "form": form, "server interval": "-"}, ours[form],
                Measured(label + (" (with)" if form == "with" else " acquire/release"),
                         samples[key], extra[key]), note=note))
    return rows


# -- latency ------------------------------------------------------------------------------------
def _agent(kind: str, after: float, interval: float, tmp: str) -> Callable[[int], None]:
    """The body of one latency sample's agent process: a server and one stuck worker, forked
    before the server's threads start."""
    def body(w: int) -> None:
        if kind == "etk":
            from elastictk import timer

            def killing(expiry: Any) -> None:  # runs right before the reaper's SIGKILL
                os.write(w, f"kill {time.monotonic()!r}\n".encode())

            server: Any = timer.TimerServer(1, on_expiry=killing)

            def arm() -> float:
                timer.attach(server.path, 0)
                t0 = time.monotonic()
                timer.acquire(after, "bench")
                return t0 + after
        elif kind == "local":
            import multiprocessing as mp

            from torch.distributed.elastic.timer import LocalTimerClient, LocalTimerServer

            queue = mp.get_context("fork").Queue()

            def arm() -> float:
                t0 = time.monotonic()
                LocalTimerClient(queue).acquire("bench", time.time() + after)
                return t0 + after
        else:
            from torch.distributed.elastic.timer import FileTimerClient, FileTimerServer

            fifo = os.path.join(tmp, f"latency-{os.getpid()}.fifo")
            server = FileTimerServer(fifo, "bench", max_interval=interval)  # makes the FIFO

            def arm() -> float:
                await_reader(fifo)
                t0 = time.monotonic()
                FileTimerClient(fifo).acquire("bench", time.time() + after)
                return t0 + after
        pid = os.fork()
        if pid == 0:
            try:
                deadline = arm()
                os.write(w, f"{os.getpid()} {deadline!r}\n".encode())
                time.sleep(LONG)
            finally:
                os._exit(0)
        if kind == "etk":
            server.watch_worker(0, pid)
        elif kind == "local":
            LocalTimerServer(queue, max_interval=interval).start()
        else:
            server.start()
        os.waitpid(pid, 0)
    return body


def _latency_sample(kind: str, after: float, interval: float, tmp: str, limit: float,
                    pids: list[int], reaper_ms: list[float]) -> float:
    agent, r = fork_helper(_agent(kind, after, interval, tmp))
    pids.append(agent)
    pidfd = -1
    try:
        worker, deadline = read_line(r, 60).split()
        pids.append(int(worker))
        pidfd = os.pidfd_open(int(worker))
        if not select.select([pidfd], [], [], limit)[0]:
            raise BenchError(f"{kind}: the stuck worker was not reaped within {limit:.0f} s")
        dead = time.monotonic()
        if kind == "etk":
            reaper_ms.append((float(read_line(r, 10).split()[1]) - float(deadline)) * 1e3)
        return (dead - float(deadline)) * 1e3
    finally:
        if pidfd >= 0:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)  # only if a server failed
            except ProcessLookupError:
                pass
            os.close(pidfd)
        os.close(r)
        kill_helper(agent)


def _latency(cfg: RunConfig, tmp: str, pids: list[int]) -> tuple[list[Comparison], list[str]]:
    # A fresh length per sample, the same for every subject of a round: with a fixed length
    # that is a multiple of torch's check interval, its wake-ups would land just after every
    # deadline and flatter it.
    base = 0.05 if cfg.quick else 0.2
    rng = random.Random(5)
    # (torch's check interval per server, whether those are torch's defaults, samples)
    groups: list[tuple[dict[str, float], bool, int]] = [({"local": 0.1, "file": 0.1}, False,
                                                         cfg.rounds)]
    if not cfg.quick:
        groups.insert(0, ({"local": 60.0, "file": 10.0}, True, DEFAULT_ROUNDS))
    rows, notes = [], []
    reaper_ms: list[float] = []
    for intervals, default, rounds in groups:
        afters = [base + rng.uniform(0, 0.1) for _ in range(rounds)]
        taken = {"etk": 0, "local": 0, "file": 0}

        def sample(kind: str, intervals: dict[str, float] = intervals,
                   afters: list[float] = afters, taken: dict[str, int] = taken) -> float:
            after = afters[taken[kind]]
            taken[kind] += 1
            interval = intervals.get(kind, 0.0)
            return _latency_sample(kind, after, interval, tmp, 3 * interval + 30, pids, reaper_ms)

        cfg.log(f"timer latency: torch intervals {intervals}, {rounds} rounds")
        s = interleaved(["etk", "local", "file"], sample, rounds)
        ours = Measured("TimerServer (10 ms scan, stacks dumped)", s["etk"])
        for kind, name in (("local", "LocalTimerServer"), ("file", "FileTimerServer")):
            interval = f"{intervals[kind]:g} s" + (" (default)" if default else "")
            rows.append(Comparison({"measure": "latency", "form": "-", "server interval": interval},
                                   ours, Measured(name, s[kind])))
    if reaper_ms:
        median = statistics.median(reaper_ms)
        notes.append(
            "Of elastictk's deadline-to-death latency, its reaper's part (deadline to the "
            f"SIGKILL, stacks dumped in between) had a median of {median:.1f} ms (max "
            f"{max(reaper_ms):.1f} ms over {len(reaper_ms)} samples); the rest is the kernel "
            "ending a process that has torch loaded, which torch's servers pay as well.")
    return rows, notes


def run(cfg: RunConfig) -> BenchResult:
    import tempfile

    import torch.distributed.elastic.timer  # noqa: F401  (import once, before any fork)

    pids: list[int] = []
    with tempfile.TemporaryDirectory(prefix="etk-bench-timer-") as tmp:
        latency, latency_notes = _latency(cfg, tmp, pids)
        cost = _cost(cfg, tmp, pids)
    rows = cost + latency
    fastest = {row.ours.label: row.ours.stats.min for row in cost}
    notes = latency_notes + [
        "Fastest elastictk cost samples (the machine's noise floor; medians above are what a "
        "shared, loaded machine gives): " + ", ".join(f"{k} {v:,.0f} ns" for k, v in
                                                      fastest.items()) + ".",
        "Both measures are lower-is-better, so one unit is not enough: cost rows are ns per "
        "acquire+release pair, latency rows are ms from deadline to the worker's death. The "
        "table's unit column reads 'ns or ms' accordingly.",
        f"Latency workers take a timer of {0.05 if cfg.quick else 0.2:g} s plus a seeded random "
        f"0-0.1 s (the same for every subject of a round); torch's default-interval rows have "
        f"{DEFAULT_ROUNDS} samples each (a LocalTimerServer sample lasts a minute).",
    ]
    if cfg.quick:
        notes.append("quick mode: torch's default check intervals (60 s and 10 s) are not run.")
    return BenchResult(
        name="timer", title=TITLE, description=__doc__ or "", unit="ns (cost) or ms (latency)",
        higher_is_better=False, rows=rows, notes=notes,
        params={"long_timer_s": LONG, "default_rounds": DEFAULT_ROUNDS, "seed": 5,
                "latency_after_s": f"{0.05 if cfg.quick else 0.2:g} + U(0, 0.1)"},
        pids=pids,
    )


"""The helper processes of the timer benchmark: timer servers ("agents") forked from the
benchmark process, and the pipe plumbing that hears from them and reaps them.

Every subject's server runs in its own process, as in a real job, so the worker's cost includes
crossing to it; forking (not spawning) keeps torch imported once.
"""
from __future__ import annotations

import errno
import os
import select
import signal
import time
from typing import Any, Callable

from elastictk.lifetime.reaper import die_with_parent

from .common import BenchError


def fork_helper(body: Callable[[int], None]) -> tuple[int, int]:
    """Fork a child running ``body(write_fd)``; returns (pid, read_fd). The child never returns."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            die_with_parent(os.getppid(), signal.SIGKILL)
            os.close(r)
            body(w)
        except BaseException:  # noqa: BLE001 - a helper must never unwind into the parent's code
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def read_line(fd: int, timeout: float) -> str:
    """One line from a helper (byte by byte: the next line must stay in the pipe)."""
    buf = b""
    deadline = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise BenchError(f"a helper process said nothing for {timeout:.0f} s")
        chunk = os.read(fd, 1)
        if not chunk:
            raise BenchError("a helper process exited before it answered")
        buf += chunk
    return buf.decode().strip()


def kill_helper(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def await_reader(fifo: str, timeout: float = 30.0) -> None:
    """Until a FileTimerServer reads ``fifo`` (before that its client's open fails with ENXIO
    and torch retries, logging a traceback each time)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            return
        except OSError as e:
            if e.errno not in (errno.ENXIO, errno.ENOENT) or time.monotonic() > deadline:
                raise BenchError(f"torch's FileTimerServer never opened {fifo}: {e}") from None
            time.sleep(0.005)


def serve_etk(w: int, watch_pid: int) -> None:
    from elastictk.timer import TimerServer

    server = TimerServer(1)
    server.watch_worker(0, watch_pid)
    os.write(w, f"{server.path}\n".encode())
    signal.pause()


def serve_local(queue: Any) -> Callable[[int], None]:
    def body(w: int) -> None:
        from torch.distributed.elastic.timer import LocalTimerServer

        LocalTimerServer(queue, max_interval=60).start()
        os.write(w, b"ready\n")
        signal.pause()
    return body


def serve_file(path: str, interval: float) -> Callable[[int], None]:
    def body(w: int) -> None:
        from torch.distributed.elastic.timer import FileTimerServer

        FileTimerServer(path, "bench", max_interval=interval).start()
        os.write(w, b"ready\n")
        signal.pause()
    return body

"""Client processes for benchmarks that need real concurrency.

Threads in one interpreter would measure the GIL, not the thing under test, so concurrent
clients are processes. Starting a process that imports torch costs seconds on a small machine,
so a pool starts its clients once (forked from a forkserver that imported the handler module a
single time) and then drives them with small commands over pipes for the whole benchmark.

A handler is a plain module-level function ``handler(state, cmd, arg) -> reply``: ``state`` is a
dict private to the client process that lives as long as it does; ``reply`` must be picklable
plain data. An exception in the handler comes back as a one-line :class:`BenchError`. When the
pool closes, each client calls ``handler(state, "__exit__", None)`` to release what it holds.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

from elastictk.lifetime.reaper import die_with_parent

from .common import BenchError

Handler = Callable[[dict, str, Any], Any]


def _client_main(conn: Connection, handler_path: str, owner: int) -> None:
    # SIGKILLed with its parent (the forkserver); a vanished owner is noticed by the poll below.
    die_with_parent(os.getppid(), signal.SIGKILL)
    module, _, func = handler_path.partition(":")
    handler: Handler = getattr(importlib.import_module(module), func)
    state: dict = {}
    while True:
        # Poll with a timeout rather than block forever: a client whose owner vanished exits.
        if not conn.poll(1.0):
            if not _alive(owner):
                return
            continue
        try:
            cmd, arg = conn.recv()
        except (EOFError, OSError):
            return
        if cmd == "__exit__":
            try:
                handler(state, "__exit__", None)
            finally:
                conn.close()
            return
        if cmd == "__ping__":
            conn.send(("ok", os.getpid()))
            continue
        try:
            conn.send(("ok", handler(state, cmd, arg)))
        except Exception as e:  # reported to the owner, who raises it there
            line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            conn.send(("error", f"{type(e).__name__}: {line}"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class ClientPool:
    """``size`` client processes running ``handler`` ("module:function"); use as a context manager.

    ``preload`` names modules to import before forking (e.g. ``torch.distributed``), so each
    client starts in milliseconds instead of importing them itself.

    Leaving the ``with`` block stops every client (asking first, then by PID), also on error.
    """

    def __init__(
        self, size: int, handler: str, preload: Sequence[str] = (), start_timeout: float = 120.0
    ) -> None:
        # Modules imported once by the forkserver, before it forks the clients; one that does
        # not import is skipped there and imported by the client that needs it.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([*preload, handler.partition(":")[0]])
        self._conns: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
        self.timeout = start_timeout
        try:
            for i in range(size):
                parent, child = ctx.Pipe()
                p = ctx.Process(
                    target=_client_main, args=(child, handler, os.getpid()),
                    name=f"bench-client-{i}", daemon=True,
                )
                p.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(p)
            self.call(range(size), "__ping__", [None] * size, timeout=start_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def size(self) -> int:
        return len(self._procs)

    @property
    def pids(self) -> list[int]:
        pids = [p.pid for p in self._procs if p.pid is not None]
        server = getattr(getattr(mp.forkserver, "_forkserver", None), "_forkserver_pid", None)
        return pids + ([server] if server else [])

    def call(
        self, which: Sequence[int] | range, cmd: str, args: Sequence[Any], timeout: float
    ) -> list[Any]:
        """Send ``cmd`` to the clients ``which`` (one arg each) at once; their replies in order."""
        which = list(which)
        for i, arg in zip(which, args, strict=True):
            self._conns[i].send((cmd, arg))
        deadline = time.monotonic() + timeout
        replies: list[Any] = []
        errors: list[str] = []
        for i in which:
            conn = self._conns[i]
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise BenchError(f"benchmark client {i} did not answer {cmd!r} within {timeout:g}s")
            try:
                status, value = conn.recv()
            except EOFError:
                code = self._procs[i].exitcode
                raise BenchError(
                    f"benchmark client {i} died during {cmd!r} (exit code {code})"
                ) from None
            if status == "error":
                errors.append(f"client {i}: {value}")
            replies.append(value)
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise BenchError(f"{cmd!r} failed in {errors[0]}{more}")
        return replies

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("__exit__", None))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()  # this pool's own client, by PID
                p.join(5)
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> "ClientPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

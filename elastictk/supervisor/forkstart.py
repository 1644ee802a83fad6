"""Starting the preload server by forking its owner, which already imported torch.

``elastictk-run`` imports torch itself (its store and agent need it), and the preload server
imported it again in a fresh interpreter: about 1.3 s of CPU per node start, spent twice. A
fork made right after the owner's import hands the server torch for free; the server then
imports only the rest of its list (``torch._dynamo`` and elastictk's worker side). The time
to a ready server stays what it was, since the server's own torch import was on that path
too; the CPU saved is that import, on every node of every job start.

A fork without exec is only safe while the owner runs a single Python thread, and a CUDA
context does not survive one: :func:`can_fork` says whether both hold, and the owner starts
a fresh interpreter otherwise. The child becomes what the fresh interpreter was: its own
session, death signal against the owner, stdin on ``/dev/null``, no fd but stdio and its end
of the control socket, no handler on elastictk's logger, ``sys.path[0]`` as ``python -c``
sets it. What it keeps from the owner is imported modules, which is the point.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Optional


def can_fork() -> Optional[str]:
    """None when a fork of this process can become the server; else why not."""
    if threading.active_count() != 1:
        return f"{threading.active_count()} Python threads run here"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "CUDA is initialized here"
    return None


class ForkedChild:
    """A ``subprocess.Popen``-like handle (pid, poll, wait, kill) on a child made by ``fork``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its code is lost
                self.returncode = -int(signal.SIGKILL)
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def fork_server(run: Callable[[], None], keep_fd: int, close_fd: int) -> ForkedChild:
    """Fork a child that runs ``run`` (the server's loop) and never returns into the caller.

    ``keep_fd``: the child's end of the control socket; ``close_fd``: the owner's end, which the
    child must not hold (its EOF is how the server learns that its owner died)."""
    from ..lifetime.reaper import die_with_parent

    parent = os.getpid()
    for stream in (sys.stdout, sys.stderr):  # or the child would print the owner's buffer again
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    pid = os.fork()
    if pid:
        return ForkedChild(pid)
    code = 1
    try:
        from .forget import forget_secrets

        forget_secrets()  # the owner's token (its config, argv, environment): workers fork from here
        os.setsid()
        die_with_parent(parent, int(signal.SIGKILL))
        os.close(close_fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        from .child import close_fds_except

        close_fds_except([keep_fd])
        logger = logging.getLogger("elastictk")  # the owner's handler prints as the launcher
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)
        if sys.path and not sys.flags.safe_path:
            sys.path[0] = ""  # as for python -c; a worker puts its script's directory there
        from ..store.cpplog import as_fresh_import

        as_fresh_import()  # the owner's torch logs quietly; a fresh interpreter's would not
        run()
        code = 0
    except BaseException:  # noqa: BLE001 - never return into the owner's code
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)

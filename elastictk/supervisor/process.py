"""One worker process, however it was started, behind one small interface.

A worker is started by ``subprocess`` (scripts, modules, binaries), by ``torch.multiprocessing``
(functions: spawn, fork, forkserver) or by the preloaded fork server. The group only needs, from
each: an fd that becomes readable the moment the worker's exit is known (a pidfd, or the fork
server's status pipe for workers that are not our children), a non-blocking ``poll`` that reaps
it through its owner object (so ``subprocess``/``multiprocessing`` bookkeeping never loses a
child to a stray ``os.wait``), race-free signalling through the pidfd, and the return value.

The return value is read without ever blocking (:class:`ResultReader`): whatever the pipe holds
is taken as it arrives and the message is decoded once complete, so a worker frozen (SIGSTOP, a
debugger) in the middle of sending it cannot stall the agent; its value is lost, as after any
death mid-send, once its exit is seen.
"""
from __future__ import annotations

import os
import pickle
import struct
import subprocess
import time
from abc import ABC, abstractmethod
from functools import partial
from typing import Any, Callable, Mapping, Optional, Sequence

from .child import PassFd, function_main
from .forkserver import PreloadServer
from .forkwire import read_status
from .logs import RankLogs
from ..lifetime.reaper import die_with_parent, send_signal
from .spec import PythonTarget
from ..lifetime.ready import readable


class WorkerStartError(RuntimeError):
    """A worker could not be started (missing binary, unpicklable function, ...)."""


_FRAME = struct.Struct("!i")
_LONG_FRAME = struct.Struct("!Q")
_READ_CHUNK = 1 << 20
_READS_PER_CALL = 64  # then back to the select loop; the rest is read on the next readiness


class ResultReader:
    """A worker's return value from a pipe in ``multiprocessing.Connection`` framing (a 4-byte
    length, or -1 and an 8-byte length, then the pickle), read non-blockingly."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self._fd = fd
        self._buf = bytearray()
        self.done = False
        self.value: Any = None

    def fileno(self) -> int:
        return self._fd

    def _complete(self) -> bool:
        buf = self._buf
        if len(buf) < _FRAME.size:
            return False
        (n,) = _FRAME.unpack_from(buf)
        start = _FRAME.size
        if n == -1:
            if len(buf) < start + _LONG_FRAME.size:
                return False
            (n,) = _LONG_FRAME.unpack_from(buf, start)
            start += _LONG_FRAME.size
        if n < 0 or len(buf) < start + n:
            return False
        try:
            self.value = pickle.loads(memoryview(buf)[start:start + n])
        except Exception:  # noqa: BLE001 - a value that cannot be rebuilt here is no value
            self.value = None
        self._buf = bytearray()
        self.done = True
        return True

    def read(self, final: bool = False) -> bool:
        """Take what the pipe holds now (a bounded number of reads); True once nothing more can
        arrive: the value decoded, EOF, or ``final`` (the worker has exited, and a writer that
        has exited left everything in the pipe: what is not there now never will be)."""
        if self.done:
            return True
        for _ in range(_READS_PER_CALL):
            try:
                chunk = os.read(self._fd, _READ_CHUNK)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:  # EOF: the worker closed its end, finished or not
                self._complete()
                self.done = True
                return True
            self._buf += chunk
            if self._complete():
                return True
        if final:
            self._buf = bytearray()
            self.done = True
        return self.done

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class WorkerProcess(ABC):
    """A started worker: exit notification fd, non-blocking reap, signalling, return value."""

    def __init__(self, local_rank: int, pid: int, result: Optional[ResultReader] = None) -> None:
        self.local_rank = local_rank
        self.pid = pid
        self.started_at = time.monotonic()
        self.ended_at: Optional[float] = None
        self.returncode: Optional[int] = None
        self.return_value: Any = None
        self._result = result
        self._result_done = False
        try:
            self._pidfd: Optional[int] = os.pidfd_open(pid)
        except ProcessLookupError:  # already exited and reaped by a fork server
            self._pidfd = None

    @abstractmethod
    def exit_fd(self) -> int:
        """Readable once ``poll`` can return the exit."""

    @abstractmethod
    def _reap(self) -> Optional[int]:
        """Popen-style return code if the worker has exited (reaping it), else None."""

    def result_fd(self) -> Optional[int]:
        """Readable when the return value (or EOF) is waiting; None once it was taken."""
        if self._result is None or self._result_done:
            return None
        return self._result.fileno()

    def take_result(self, final: bool = False) -> bool:
        """Read what has arrived of the return value, never blocking; True once nothing more
        can arrive. ``final`` (the worker has exited): give up on what is missing."""
        if self._result is None or self._result_done:
            return True
        if self._result.read(final):
            self.return_value = self._result.value
            self._result_done = True
        return self._result_done

    def poll(self) -> Optional[int]:
        """The return code once the worker has exited (reaping it); never blocks.

        fds stay open until ``close`` so a caller can unregister them from a selector first.
        """
        if self.returncode is None:
            rc = self._reap()
            if rc is None:
                return None
            self.ended_at = time.monotonic()
            self.returncode = rc
            self.take_result(final=True)
        return self.returncode

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to the worker itself; False when it has already exited."""
        pidfd = self._pidfd
        if self.returncode is not None or pidfd is None:
            return False
        try:
            return send_signal(pidfd, sig)
        except OSError:  # closed under us (a signal handler racing close())
            return False

    def private_fds(self) -> list[int]:
        """Agent-side fds a forked sibling must not keep open."""
        fds = [self._pidfd, self._result.fileno() if self._result is not None else None]
        return [fd for fd in fds if fd is not None]

    def close(self) -> None:
        """Release the pidfd and the result pipe (after unregistering them)."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if self._result is not None:
            self._result.close()
            self._result = None


class SubprocessWorker(WorkerProcess):
    """A worker started as its own program (``subprocess.Popen``)."""

    def __init__(self, local_rank: int, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        super().__init__(local_rank, popen.pid)

    def exit_fd(self) -> int:
        assert self._pidfd is not None
        return self._pidfd

    def _reap(self) -> Optional[int]:
        return self._popen.poll()


class MultiprocessingWorker(WorkerProcess):
    """A function worker started by a ``torch.multiprocessing`` context."""

    def __init__(self, local_rank: int, process: Any, result: ResultReader) -> None:
        self._process = process
        super().__init__(local_rank, process.pid, result)

    def exit_fd(self) -> int:
        assert self._pidfd is not None
        return self._pidfd

    def _reap(self) -> Optional[int]:
        # Process.join(0) waits on the sentinel pipe, which a grandchild may still hold open
        # after the worker died; the Popen object's poll is a plain waitpid(pid, WNOHANG).
        rc = self._process._popen.poll(os.WNOHANG)
        if rc is not None:
            self._process.close()  # releases the sentinel and multiprocessing's bookkeeping
        return rc


class PreloadWorker(WorkerProcess):
    """A worker forked by the preload server; its exit arrives on a status pipe."""

    def __init__(self, local_rank: int, pid: int, status_fd: int, death_signal: int,
                 result: Optional[ResultReader]) -> None:
        self._status = status_fd
        self._death_signal = death_signal
        self.from_standby = False  # a promoted standby, not a fresh fork
        super().__init__(local_rank, pid, result)

    def exit_fd(self) -> int:
        return self._status

    def _reap(self) -> Optional[int]:
        if not readable([self._status], 0):
            return None
        rc = read_status(self._status)
        if rc is None:  # the server died; the worker dies of its death signal
            if self._pidfd is not None:
                readable([self._pidfd], 5.0)
            rc = -self._death_signal
        return rc

    def private_fds(self) -> list[int]:
        return super().private_fds() + ([self._status] if self._status >= 0 else [])

    def close(self) -> None:
        super().close()
        if self._status >= 0:
            os.close(self._status)
            self._status = -1


# -- starting ----------------------------------------------------------------------------------

def start_subprocess(local_rank: int, argv: Sequence[str], env: Mapping[str, str],
                     logs: RankLogs, death_signal: int) -> SubprocessWorker:
    """Start a program in its own session with the death signal set before ``exec``."""
    try:
        popen = subprocess.Popen(
            list(argv), env=dict(env), stdout=logs.child_stdout, stderr=logs.child_stderr,
            close_fds=True, start_new_session=True,
            preexec_fn=partial(die_with_parent, os.getpid(), death_signal),
        )
    except OSError as e:
        raise WorkerStartError(
            f"cannot start local rank {local_rank}: {argv[0]!r}: {e.strerror or e}; "
            "check the program path (or pass a Python script)") from None
    return SubprocessWorker(local_rank, popen)


def start_multiprocessing(local_rank: int, ctx: Any, fn: Callable[..., Any],
                          args: tuple[Any, ...], env: Mapping[str, str], logs: RankLogs,
                          death_signal: int, inherited: Sequence[int]) -> MultiprocessingWorker:
    """Start ``fn(*args)`` with ``ctx`` (spawn/fork/forkserver); ``inherited`` are agent fds a
    fork child closes first."""
    r, w = os.pipe2(os.O_CLOEXEC)
    reader = ResultReader(r)
    method = ctx.get_start_method()
    out = PassFd(logs.child_stdout) if logs.child_stdout is not None else None
    err = PassFd(logs.child_stderr) if logs.child_stderr is not None else None
    close_in_child = tuple(inherited) + (r,) if method == "fork" else ()
    process = ctx.Process(
        target=function_main, name=f"elastictk-worker-{local_rank}", daemon=False,
        args=(fn, args, dict(env), out, err, PassFd(w), os.getpid(), death_signal, close_in_child),
    )
    try:
        process.start()
    except Exception as e:  # noqa: BLE001 - pickling errors surface as many types
        reader.close()
        raise WorkerStartError(
            f"cannot start local rank {local_rank} with start method {method!r}: "
            f"{type(e).__name__}: {e}; the function and its args must be picklable "
            "(define it at module level)") from None
    finally:
        os.close(w)
    return MultiprocessingWorker(local_rank, process, reader)


def start_preloaded(local_rank: int, server: PreloadServer, env: Mapping[str, str],
                    logs: RankLogs, death_signal: int, *, target: Optional[PythonTarget] = None,
                    fn: Optional[Callable[..., Any]] = None,
                    args: tuple[Any, ...] = (), sys_path: Sequence[str] = (),
                    standby: bool = False) -> PreloadWorker:
    """Fork a worker from the preload server: a script/module ``target`` or a function;
    ``standby``: the server's standby becomes it, if it holds one (``from_standby``)."""
    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    fds: dict[str, int] = {"status": status_w}
    if logs.child_stdout is not None:
        fds["stdout"] = logs.child_stdout
    if logs.child_stderr is not None:
        fds["stderr"] = logs.child_stderr
    header: dict[str, Any] = {"env": dict(env), "cwd": os.getcwd(), "death_signal": death_signal}
    payload = b""
    reader: Optional[ResultReader] = None
    result_w: Optional[int] = None
    if fn is not None:
        try:
            payload = pickle.dumps((fn, args))
        except Exception as e:  # noqa: BLE001
            os.close(status_r)
            os.close(status_w)
            raise WorkerStartError(f"cannot pickle the worker function for local rank "
                                   f"{local_rank}: {type(e).__name__}: {e}") from None
        r, result_w = os.pipe2(os.O_CLOEXEC)
        reader = ResultReader(r)
        fds["result"] = result_w
        header.update(kind="function", sys_path=list(sys_path))
    else:
        assert target is not None
        header.update(kind=target.kind, target=target.target, args=list(target.args))
    try:
        pid = server.spawn(header, fds, payload, standby=standby)
    except Exception:
        os.close(status_r)
        if reader is not None:
            reader.close()
        raise
    finally:
        os.close(status_w)
        if result_w is not None:
            os.close(result_w)
    os.set_blocking(status_r, False)
    worker = PreloadWorker(local_rank, pid, status_r, death_signal, reader)
    worker.from_standby = standby and server.last_from_standby
    return worker


# multiprocessing's forkserver is one per process; groups using it share it, and the last one
# to close stops it if a group started it, so no forkserver outlives the groups that used it.
_mp_users = 0
_mp_started_here = False


def acquire_mp_forkserver() -> None:
    global _mp_users, _mp_started_here
    from multiprocessing import forkserver

    if _mp_users == 0:
        _mp_started_here = getattr(forkserver._forkserver, "_forkserver_pid", None) is None
    _mp_users += 1


def release_mp_forkserver() -> None:
    global _mp_users
    from multiprocessing import forkserver

    _mp_users -= 1
    if _mp_users == 0 and _mp_started_here:
        stop = getattr(forkserver._forkserver, "_stop", None)
        if stop is not None:
            stop()

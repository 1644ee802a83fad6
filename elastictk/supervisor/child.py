"""Code that runs inside a worker before the user's code: session, death signal, fds, env.

Shared by function workers (started by ``multiprocessing``) and by children of the preloaded
fork server, so both kinds see the same world a ``subprocess`` worker sees: their own session,
stdout/stderr on the log files or tee pipes, the exact torchrun environment, and death when the
agent dies. Imports only the standard library (and elastictk's ``record``), so a spawned worker
does not pay for anything it does not use.
"""
from __future__ import annotations

import faulthandler
import importlib
import io
import os
import runpy
import sys
import traceback
from types import TracebackType
from typing import Any, Callable, Iterable, Mapping, Optional

from ..lifetime.reaper import die_with_parent


class PassFd:
    """A file descriptor that travels to a ``multiprocessing`` child (spawn, forkserver or fork).

    For spawn/forkserver it pickles through ``multiprocessing.reduction.DupFd``, which hands the
    fd to the child the way ``Connection`` objects travel; for fork it is simply inherited.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (PassFd._rebuild, (reduction.DupFd(self.fd),))

    @staticmethod
    def _rebuild(dup: Any) -> "PassFd":
        return PassFd(dup.detach())


def close_fds_except(keep: Iterable[int]) -> None:
    """Close every fd above 2 not in ``keep``: a forked child must not hold the agent's pipes
    (a pipe write end held by a worker would hide the agent's death from the death watch)."""
    keep_sorted = sorted({fd for fd in keep if fd > 2})
    low = 3
    for fd in keep_sorted + [os.sysconf("SC_OPEN_MAX")]:
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1


def _unbuffered_stdio() -> None:
    """``python -u`` semantics for stdout/stderr, as torchrun runs scripts with ``-u``."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False), encoding="utf-8",
            errors="backslashreplace", line_buffering=True, write_through=True,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _rebind(name: str, fd: int) -> None:
    """Point ``sys.<name>`` at ``fd`` if it writes elsewhere (a forked child may inherit a
    stream object of the agent that wraps another fd, e.g. under output capture)."""
    stream = getattr(sys, name)
    try:
        if stream is not None and stream.fileno() == fd:
            return
    except (AttributeError, OSError, ValueError):
        pass
    try:
        stream.flush()
    except Exception:  # noqa: BLE001 - the old stream may be closed; it is replaced anyway
        pass
    new = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                           errors="backslashreplace", line_buffering=True)
    setattr(sys, name, new)


def become_worker(
    *,
    env: Mapping[str, str],
    stdout_fd: Optional[int],
    stderr_fd: Optional[int],
    parent_pid: int,
    death_signal: int,
    new_session: bool = True,
) -> None:
    """Turn the current process into a worker: session, death signal, streams, environment."""
    if new_session:
        try:
            os.setsid()
        except PermissionError:  # already a group leader (e.g. started with a new session)
            pass
    die_with_parent(parent_pid, death_signal)
    for src, dst, name in ((stdout_fd, 1, "stdout"), (stderr_fd, 2, "stderr")):
        if src is not None and src != dst:
            os.dup2(src, dst)
            os.close(src)
            _rebind(name, dst)
    if stderr_fd is not None and faulthandler.is_enabled():
        # A forked child inherits the agent's handler, which writes to the agent's stderr.
        faulthandler.enable(file=2, all_threads=True)
    os.environ.clear()
    os.environ.update(env)
    # A forked worker never runs sitecustomize, so the collective timeout is turned on here
    # (subprocess workers get it from the timer's sitecustomize instead).
    from ..timer.boot import activate_from_env

    activate_from_env()
    # A forked worker's timing makes torch's exit-time GIL deadlock of DDP models likely.
    from .groupkeep import install

    install()
    # The hooks the launcher named (fault injection's and the metrics' step counts), by name:
    # this package imports none of them (subprocess workers: elastictk/faults/env.py).
    for name in os.environ.get("ELASTICTK_WORKER_HOOKS", "").split(","):
        if name.strip().startswith("elastictk."):
            try:
                importlib.import_module(name.strip()).activate_from_env()
            except Exception as e:  # noqa: BLE001 - a hook must never stop the worker
                print(f"elastictk: worker hook {name} is off: {e!r}", file=sys.stderr)


def _recorded(fn: Callable[..., Any]) -> Callable[..., Any]:
    from .errors import record  # writes TORCHELASTIC_ERROR_FILE on an exception

    return record(fn)


def function_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: Mapping[str, str],
    stdout: Optional[PassFd],
    stderr: Optional[PassFd],
    result: PassFd,
    parent_pid: int,
    death_signal: int,
    inherited: tuple[int, ...] = (),
) -> None:
    """Target of a function worker's ``multiprocessing.Process``: run ``fn``, send its value.

    The return value goes back pickled on a pipe owned by this rank (as torch's
    ``start_processes`` does with a queue); the agent reads it while the worker is still alive,
    so a large value never blocks the worker's exit.
    """
    for fd in inherited:  # fork: the agent's private fds (death-watch pipe, pidfds, ...)
        try:
            os.close(fd)
        except OSError:
            pass
    become_worker(
        env=env,
        stdout_fd=stdout.fd if stdout else None,
        stderr_fd=stderr.fd if stderr else None,
        parent_pid=parent_pid, death_signal=death_signal,
    )
    from multiprocessing.connection import Connection

    conn = Connection(result.fd, readable=False)
    value = _recorded(fn)(*args)
    conn.send(value)
    conn.close()


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def run_python(kind: str, target: str, args: Iterable[str]) -> int:
    """Run a script or module as ``__main__`` the way ``python -u`` would; the exit code."""
    _unbuffered_stdio()
    # sys.path[0] is what ``python script.py`` / ``python -m mod`` would put there.
    first = os.path.dirname(os.path.abspath(target)) if kind == "script" else os.getcwd()
    if sys.path and sys.path[0] in ("", "."):
        sys.path[0] = first
    else:
        sys.path.insert(0, first)
    sys.argv = [target, *args]  # for a module, runpy replaces argv[0] with its file
    path = os.path.abspath(target)
    code = 0
    try:
        if kind == "script":
            runpy.run_path(path, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:  # noqa: BLE001 - report like the interpreter, then exit 1
        report_uncaught(e)
        _record_if_unrecorded(e)
        code = 1
    return code


def _record_if_unrecorded(e: BaseException) -> None:
    """Write the error file for an exception the script's own ``@elastictk.record`` did not
    (a script without it, or a SyntaxError/ImportError raised before its main runs), so the
    failure summary names the exception instead of "exit code 1". A file already there (the
    decorator's, maybe a nested launcher's root cause) is kept; Ctrl-C is not an error."""
    if not isinstance(e, Exception):
        return
    from .errors import ERROR_FILE_ENV, exception_payload, write_error_file

    path = os.environ.get(ERROR_FILE_ENV)
    if not path or os.path.lexists(path):
        return
    import time

    payload = exception_payload(e, timestamp=int(time.time()))
    if sys.excepthook is not sys.__excepthook__:
        # The script chose how its tracebacks read (rich, a logger): the summary names the
        # exception, and shows what the script printed, not a second traceback of ours.
        payload["message"]["extraInfo"]["py_callstack"] = ""
    try:
        write_error_file(path, payload)
    except Exception:  # noqa: BLE001 - the worker's own exception matters more than the report
        pass


def _launcher_frame(tb: TracebackType) -> bool:
    from . import errors  # the @record wrapper a function worker runs under

    name = tb.tb_frame.f_code.co_filename
    return name in (__file__, errors.__file__, runpy.__file__, "<frozen runpy>")


def report_uncaught(e: BaseException) -> None:
    """Print an exception that ended the worker's main as ``python script.py`` would: the
    user's frames only (the ones of this module and runpy above them are the launcher's, not
    the script's, and torchrun's workers show none), through ``sys.excepthook`` so a script
    that installs its own (rich tracebacks, a logger) still gets it."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None and _launcher_frame(tb):
        tb = tb.tb_next
    e.__traceback__ = tb  # the interpreter's hook prints the exception's own traceback
    try:
        sys.excepthook(type(e), e, tb)
    except BaseException:  # noqa: BLE001 - a broken hook must not hide the error
        traceback.print_exception(type(e), e, tb)


def call_function(fn: Callable[..., Any], args: tuple[Any, ...], result_fd: int) -> int:
    """Run a pickled function in a preloaded child and send its value; the exit code."""
    from multiprocessing.connection import Connection

    _unbuffered_stdio()
    conn = Connection(result_fd, readable=False)
    try:
        value = _recorded(fn)(*args)
        conn.send(value)
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:  # noqa: BLE001
        report_uncaught(e)
        code = 1
    finally:
        conn.close()
    return code


def finish_interpreter(code: int) -> None:
    """Leave a forked worker the way an interpreter exits: join non-daemon threads, run
    ``atexit`` handlers, flush the streams; then ``_exit`` so nothing of the server runs."""
    import atexit
    import threading

    for step in (getattr(threading, "_shutdown", None), atexit._run_exitfuncs):
        try:
            if step is not None:
                step()
        except BaseException:  # noqa: BLE001 - exiting regardless
            traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not change the exit code
            pass
    os._exit(code)

"""The fork server's own process: preload, then fork one child per request and report its exit
on a status pipe; keep a standby forked ahead when asked (see forkserver.py for the design).
Apart from ``PreloadServer`` (its owner's handle, in the agent) because this code runs only in
the server and its children, never in the process that owns them."""
from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import sys
import time
from typing import Any, Optional, Sequence

from ..lifetime.ready import readable
from .forkwarm import prewarm, warm, warm_collectives
from .forkwire import FD_NAMES, STATUS, recv_frame, send_frame

# What every child imports on its way to the user's code (become_worker, titles, @record, the
# timer's and metrics' activation), about 40 ms when each child imports it itself: the server
# imports it once, after the preload list.
WORKER_SIDE = ("runpy", "elastictk.supervisor.child", "elastictk.supervisor.titles",
               "elastictk.supervisor.errors", "elastictk.timer.boot", "elastictk.timer.collectives",
               "elastictk.metrics.worker", "setproctitle")
STANDBY_DELAY = 0.5  # seconds after a promotion (or the request) before a standby is forked


def _child(ctl: socket.socket, header: dict[str, Any], payload: bytes, fds: dict[str, int],
           server_pid: int) -> None:
    """In the forked child: become the worker and run it; never returns."""
    try:
        ctl.detach()  # the fd closes below; the socket object must not close a reused number
        status = fds.pop("status")
        os.close(status)
        _child_prologue(fds.values())
    except BaseException:  # noqa: BLE001 - the worker must exit, never return into the server
        import traceback

        traceback.print_exc()
        os._exit(1)
    _become(header, payload, fds, server_pid)


def _child_prologue(keep: Any) -> None:
    """What every forked child does first: only its own fds, default signal handlers."""
    from .child import close_fds_except

    close_fds_except(keep)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _become(header: dict[str, Any], payload: bytes, fds: dict[str, int], server_pid: int) -> None:
    """Become the worker ``header`` describes (a fresh fork or a promoted standby); never returns."""
    from .child import become_worker, call_function, finish_interpreter, run_python
    from .titles import function_title, set_title, worker_title

    code = 1
    try:
        os.chdir(header["cwd"])
        become_worker(env=header["env"], stdout_fd=fds.get("stdout"), stderr_fd=fds.get("stderr"),
                      parent_pid=server_pid, death_signal=int(header["death_signal"]))
        if header["kind"] == "function":
            sys.path[:] = header["sys_path"]
            fn, args = pickle.loads(payload)
            set_title(*function_title(getattr(fn, "__qualname__", "function"),
                                      int(header["env"].get("LOCAL_RANK", -1))))
            code = call_function(fn, tuple(args), fds["result"])
        else:
            from .usersite import rerun_sitecustomize

            rerun_sitecustomize()  # as the fresh interpreter of a torchrun worker would
            set_title(*worker_title(header["kind"], header["target"], header["args"]))
            code = run_python(header["kind"], header["target"], header["args"])
    except BaseException:  # noqa: BLE001 - the worker must exit, never return into the server
        import traceback

        traceback.print_exc()
    finally:
        finish_interpreter(code)


def _standby(ctl: socket.socket, mine: socket.socket, recipe: dict[str, Any], server_pid: int) -> None:
    """In a forked standby: get ready, wait to be promoted, then become the worker; never
    returns. EOF on its socket (the server closed it, or died) ends it quietly."""
    from ..lifetime.reaper import die_with_parent
    from .titles import set_title, standby_title

    try:
        ctl.detach()
        _child_prologue([mine.fileno()])
        os.setsid()
        die_with_parent(server_pid, int(signal.SIGKILL))
        set_title(*standby_title(recipe.get("job")))
        os.chdir(recipe["cwd"])
        prewarm(recipe)
        warm_collectives()
        header, payload, raw = recv_frame(mine, maxfds=len(FD_NAMES))
        fds = dict(zip(header["fds"], raw))
        mine.close()
    except BaseException:  # noqa: BLE001 - EOF (dropped) or a broken standby: it just goes
        os._exit(0)
    _become(header, payload, fds, server_pid)


def serve(ctl_fd: int, preload: Sequence[str], job: str | None = None) -> None:
    """The server's main loop: preload, report ready, fork on request, report exits."""
    from .titles import server_title, set_title

    set_title(*server_title(job))
    # A scheduler signals every process of a job (Slurm's scancel --signal, --signal=USR1@T),
    # and the workers die with this server: it ends on its owner's EOF only. Its children
    # take the default dispositions back (_child_prologue).
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    ctl = socket.socket(fileno=ctl_fd)
    ctl_fd = ctl.fileno()
    server_pid = os.getpid()
    t0 = time.monotonic()
    failed: dict[str, str] = {}
    for name in preload:
        try:
            __import__(name)
        except Exception as e:  # noqa: BLE001 - a missing optional module only costs speed
            failed[name] = f"{type(e).__name__}: {e}"
    for name in WORKER_SIDE:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - imported again (and reported) where it is used
            pass
    warm()
    send_frame(ctl, {"ready": True, "seconds": time.monotonic() - t0, "failed": failed})

    # A child that exits stays a zombie until its owner closes the status pipe (reads the
    # status and lets the worker go): the worker's PID, and so its session and process group
    # ids, cannot be reused while the owner may still signal or inspect them.
    poller = select.poll()
    poller.register(ctl_fd, select.POLLIN)
    running: dict[int, tuple[int, int]] = {}  # pidfd -> (pid, status pipe write end)
    held: dict[int, int] = {}  # status pipe write end -> pidfd of the zombie it holds
    spare = _Spares(ctl, server_pid, poller, job)
    while True:
        events = poller.poll(spare.poll_ms())
        spare.refill_if_due()
        for fd, _ in events:
            if fd == ctl_fd:
                try:
                    header, payload, raw = recv_frame(ctl, maxfds=len(FD_NAMES))
                except (EOFError, OSError):
                    for pid, _w in running.values():  # owner gone: its workers go too
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except OSError:
                            pass
                    spare.drop()
                    os._exit(0)
                op = header.get("op", "spawn")
                if op != "spawn":
                    send_frame(ctl, spare.request(op, header))
                    continue
                fds = dict(zip(header["fds"], raw))
                promoted = spare.promote(header, payload, fds) if header.get("standby") else None
                if promoted is not None:
                    pid, pidfd = promoted
                else:
                    pid = os.fork()
                    if pid == 0:
                        _child(ctl, header, payload, fds, server_pid)
                    pidfd = os.pidfd_open(pid)
                    poller.register(pidfd, select.POLLIN)
                for name, child_fd in fds.items():
                    if name != "status":
                        os.close(child_fd)
                running[pidfd] = (pid, fds["status"])
                send_frame(ctl, {"pid": pid, "standby": promoted is not None})
            elif fd in running:  # exited: report, keep the zombie
                poller.unregister(fd)
                _pid, status_w = running.pop(fd)
                info = os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOWAIT)
                code = 0
                if info is not None:
                    code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                try:
                    os.write(status_w, STATUS.pack(code))
                except OSError:  # the owner is gone already
                    _release(fd, status_w)
                    continue
                held[status_w] = fd
                poller.register(status_w, 0)  # POLLERR once the owner closes its end
            elif fd in held:
                poller.unregister(fd)
                _release(held.pop(fd), fd)
            elif spare.owns(fd):
                spare.died()


class _Spares:
    """The server's standby: the recipe it was asked to keep one for, the standby process
    (pid, pidfd, the server's end of its socket), and when the next one is due."""

    def __init__(self, ctl: socket.socket, server_pid: int, poller: "select.poll",
                 job: Optional[str]) -> None:
        self.ctl = ctl
        self.job = job
        self.server_pid = server_pid
        self.poller = poller
        self.recipe: Optional[dict[str, Any]] = None
        self.pid: Optional[int] = None
        self.pidfd = -1
        self.sock: Optional[socket.socket] = None
        self.due: Optional[float] = None  # monotonic time to fork the next standby

    def request(self, op: str, header: dict[str, Any]) -> dict[str, Any]:
        """An owner's request other than a spawn; the reply."""
        if op == "keep_standby":
            self.recipe = dict(header.get("recipe") or {})
            if self.pid is None:
                self.due = time.monotonic() + float(header.get("delay", STANDBY_DELAY))
        elif op == "drop_standby":
            self.recipe = self.due = None
            self.drop()
        elif op != "standby_pid":
            return {"error": f"unknown request {op!r}"}
        return {"pid": self.pid}

    def poll_ms(self) -> Optional[int]:
        if self.due is None:
            return None
        return max(0, int((self.due - time.monotonic()) * 1000) + 1)

    def refill_if_due(self) -> None:
        if self.due is None or time.monotonic() < self.due or self.recipe is None:
            return
        self.due = None
        if self.pid is not None:
            return
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            mine.detach()
            _standby(self.ctl, theirs, dict(self.recipe, job=self.job), self.server_pid)
        theirs.close()
        self.pid, self.sock = pid, mine
        self.pidfd = os.pidfd_open(pid)
        self.poller.register(self.pidfd, select.POLLIN)

    def owns(self, fd: int) -> bool:
        return self.pid is not None and fd == self.pidfd

    def promote(self, header: dict[str, Any], payload: bytes,
                fds: dict[str, int]) -> Optional[tuple[int, int]]:
        """Hand a spawn to the standby: (pid, pidfd), now a running worker's; None when there
        is none alive (the caller forks). The next standby is due STANDBY_DELAY later."""
        if self.pid is None or self.sock is None or readable([self.pidfd], 0):
            return None
        names = [n for n in header["fds"] if n != "status"]
        try:
            send_frame(self.sock, dict(header, fds=names), payload, [fds[n] for n in names])
        except OSError:
            return None  # it died meanwhile; its exit is seen as the standby's (died())
        pid, pidfd = self.pid, self.pidfd
        self.sock.close()
        self.pid, self.pidfd, self.sock = None, -1, None
        if self.recipe is not None:
            self.due = time.monotonic() + STANDBY_DELAY
        return pid, pidfd

    def died(self) -> None:
        """The standby exited before it was needed (killed, or its prewarm ended it): reaped;
        the next one is forked only when a promotion or a new request asks again."""
        self.poller.unregister(self.pidfd)
        try:
            os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED)
        except ChildProcessError:
            pass
        self._forget()

    def drop(self) -> None:
        """Kill and reap the standby, if any (the owner asked, or is gone)."""
        if self.pid is None:
            return
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except OSError:
            pass
        self.died()

    def _forget(self) -> None:
        os.close(self.pidfd)
        if self.sock is not None:
            self.sock.close()
        self.pid, self.pidfd, self.sock = None, -1, None


def _release(pidfd: int, status_w: int) -> None:
    """Reap a reported child and close its fds."""
    try:
        os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
    except ChildProcessError:
        pass
    os.close(pidfd)
    os.close(status_w)

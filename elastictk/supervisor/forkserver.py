"""A preloaded fork server: restarted workers fork from a process that already imported torch.

Importing torch, torch.distributed and what the first optimizer step pulls in (torch._dynamo,
sympy, ...) costs seconds per worker per restart. The server pays it once: it imports the
preload list, then forks one child per request and runs the worker's script (``runpy``, as
``python -u script`` / ``python -u -m module``) or pickled function in it.

Lifetime: a ``PreloadServer`` object owns the server. The server dies with its owner: it has
``PR_SET_PDEATHSIG`` (SIGKILL) and exits when its end of the control socket reads EOF, which the
kernel causes however the owner dies; its children in turn have the death signal set against
the server. ``close()`` shuts it down and reaps it.

Protocol on a UNIX socketpair: each request is a length-prefixed JSON header (plus, for a
function, a pickled ``(fn, args)`` payload between two of our own processes), with the worker's
stdout/stderr, a status pipe and a result pipe passed as fds (SCM_RIGHTS). The reply is the
child's pid. When the child exits the server writes its Popen-style return code to the status
pipe, so the agent learns of the exit by ``select`` on that pipe without being its parent, and
reaps the child only when the agent closes that pipe: until the agent has seen the exit, the
worker's PID (its session and process group id) stays allocated and cannot name anyone else.

Hot standby (in-place recovery): asked to (``keep_standby``), the server keeps one more child
forked ahead of need, a *standby*: its own session, a death signal against the server, the
script's installed-package imports done (``_prewarm``), waiting on a socket of its own. A spawn
that asks for it (``spawn(..., standby=True)``, a replacement worker) is handed to the standby
with the same header and fds a fork would get: it becomes that worker at once (environment,
streams, title, ``runpy``), and its pid is the reply, so a recovery pays neither the fork nor
the start of a process. A new standby is forked ``STANDBY_DELAY`` seconds after the
promotion (or the request), not during the recovery or start it would slow down. A standby
is no worker until promoted: no rank, no environment of one, not in any group's pids or
metrics. It dies with the server (death signal, EOF on its socket) and with ``drop_standby``.

Caveat: preloaded modules were imported with the server's environment, so a module that reads
an environment variable at import time sees the agent's value, not the worker's.
"""
from __future__ import annotations

import json
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any, Mapping, Optional, Sequence

from ..lifetime.ready import readable
from .forkstart import ForkedChild, can_fork, fork_server

DEFAULT_PRELOAD = ("torch", "torch.optim", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
                   "elastictk.inplace.loop", "elastictk.faults")  # what replacement workers import
_LEN = struct.Struct("!I")
_STATUS = struct.Struct("!i")
_FD_NAMES = ("stdout", "stderr", "status", "result")
# What every child imports on its way to the user's code (become_worker, titles, @record, the
# timer's and metrics' activation), about 40 ms when each child imports it itself: the server
# imports it once, after the preload list.
WORKER_SIDE = ("runpy", "elastictk.supervisor.child", "elastictk.supervisor.titles",
               "elastictk.supervisor.errors", "elastictk.timer.boot", "elastictk.timer.collectives",
               "elastictk.metrics.worker", "setproctitle")
STANDBY_DELAY = 0.5  # seconds after a promotion (or the request) before a standby is forked


class ForkServerError(RuntimeError):
    """The fork server could not start or could not start a worker; the message says why."""


def _send_frame(sock: socket.socket, header: Mapping[str, Any], payload: bytes = b"",
                fds: Sequence[int] = ()) -> None:
    body = json.dumps(header).encode()
    data = _LEN.pack(len(body)) + body + payload
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("control socket closed")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket, maxfds: int = 0) -> tuple[dict[str, Any], bytes, list[int]]:
    head, fds, _, _ = socket.recv_fds(sock, _LEN.size, maxfds)
    if not head:
        raise EOFError("control socket closed")
    head += _recv_exact(sock, _LEN.size - len(head))
    (length,) = _LEN.unpack(head)
    header = json.loads(_recv_exact(sock, length))
    payload = _recv_exact(sock, int(header.get("payload_len", 0)))
    return header, payload, list(fds)


# -- server side -------------------------------------------------------------------------------

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
        _prewarm(recipe)
        _warm_collectives()
        header, payload, raw = _recv_frame(mine, maxfds=len(_FD_NAMES))
        fds = dict(zip(header["fds"], raw))
        mine.close()
    except BaseException:  # noqa: BLE001 - EOF (dropped) or a broken standby: it just goes
        os._exit(0)
    _become(header, payload, fds, server_pid)


def script_imports(path: str) -> list[str]:
    """The absolute imports at a script's top level (also inside top-level ``try``/``if``),
    in order: what its replacement would import first."""
    import ast

    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, (ast.Try, ast.If)):
            todo[:0] = list(node.body)
    return list(dict.fromkeys(names))


def _warm_collectives() -> None:
    """Form, use and destroy a one-rank gloo group, in a standby only: the first group a process
    forms pays for lazy imports and first calls (5-15 ms here, measured), and a replacement's
    first act is to form one while its peers wait. Destroying the default group resets what
    forming it set (group names count from 0 again); its threads end with it. Not in the server:
    a fork does not carry threads over."""
    dist = sys.modules.get("torch.distributed")
    torch = sys.modules.get("torch")
    if dist is None or torch is None or not dist.is_available() or dist.is_initialized():
        return
    try:
        import datetime

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        t = torch.zeros(1)
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.all_gather([torch.zeros(1)], t)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - only speed is at stake
        pass


def _prewarm(recipe: dict[str, Any]) -> None:
    """Import what the script imports from installed packages, ahead of its promotion.

    Only modules outside the script's directory and the working directory: the user's own
    modules may read the worker's environment (``RANK``, ``LOCAL_RANK``) at import, which the
    standby does not have yet; an installed library costs the same import time and, like the
    preloaded modules, sees the server's environment. Any failure only costs speed.
    """
    if recipe.get("kind") != "script" or not recipe.get("target"):
        return
    import importlib.util

    script = os.path.abspath(os.path.join(recipe["cwd"], recipe["target"]))
    local = {os.path.dirname(script), os.path.abspath(recipe["cwd"])}
    for name in script_imports(script):
        if name in sys.modules:
            continue
        try:
            spec = importlib.util.find_spec(name.split(".")[0])
            origin = (spec.origin or "") if spec is not None else ""
            if spec is None or any(origin.startswith(d + os.sep) for d in local):
                continue
            __import__(name)
        except BaseException:  # noqa: BLE001 - ImportError, SystemExit, anything: skip it
            continue


def _warm() -> None:
    """Pay torch's first-call costs once, here, instead of in every forked worker.

    ``torch.manual_seed`` (the first line of most training scripts) queues a lazy CUDA seeding
    that captures a formatted stack, reading torch's source files into ``linecache`` (about
    6 ms); done here, the children inherit the cache. Seeding with ``initial_seed()`` leaves
    the generator exactly as a fresh interpreter has it. A one-element ``torch.save``/``load``
    round trip sets up the serialization paths an in-place recovery sends the state through
    (a few ms on each side). Nothing here starts a thread, which a fork would not carry over.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        import io

        torch.manual_seed(torch.initial_seed())
        buf = io.BytesIO()
        torch.save({"warm": torch.zeros(1)}, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception:  # noqa: BLE001 - only speed is at stake
        pass


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
    _warm()
    _send_frame(ctl, {"ready": True, "seconds": time.monotonic() - t0, "failed": failed})

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
                    header, payload, raw = _recv_frame(ctl, maxfds=len(_FD_NAMES))
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
                    _send_frame(ctl, spare.request(op, header))
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
                _send_frame(ctl, {"pid": pid, "standby": promoted is not None})
            elif fd in running:  # exited: report, keep the zombie
                poller.unregister(fd)
                _pid, status_w = running.pop(fd)
                info = os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOWAIT)
                code = 0
                if info is not None:
                    code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                try:
                    os.write(status_w, _STATUS.pack(code))
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
            _send_frame(self.sock, dict(header, fds=names), payload, [fds[n] for n in names])
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


# -- owner side --------------------------------------------------------------------------------

class PreloadServer:
    """Owner of one fork server process. ``start`` returns at once (the import runs in the
    background, e.g. during rendezvous); ``spawn`` waits for it to be ready."""

    def __init__(self, preload: Sequence[str] = DEFAULT_PRELOAD, *,
                 ready_timeout: float = 300.0, request_timeout: float = 30.0,
                 job: str | None = None) -> None:
        self.preload = tuple(preload)
        self.job = job  # shown in the server's process title
        self.ready_timeout = ready_timeout
        self.request_timeout = request_timeout
        self._proc: Optional[subprocess.Popen[bytes] | ForkedChild] = None
        self.how = ""  # how start() made the server: "forked" or "a fresh interpreter (why)"
        self._sock: Optional[socket.socket] = None
        self._ready: Optional[dict[str, Any]] = None
        self.last_from_standby = False  # whether the last spawn promoted the standby

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc else None

    def fileno(self) -> Optional[int]:
        """The owner's end of the control socket (a fork-started worker must close it)."""
        return self._sock.fileno() if self._sock is not None else None

    def start(self, fork: bool = False) -> None:
        """Start the server. ``fork``: fork this process instead of starting a fresh interpreter
        when that is safe (:mod:`.forkstart`), so the modules imported here are not imported
        again; ``how`` then says which it was."""
        if self._proc is not None:
            return
        from ..lifetime.reaper import claim_child, dies_with_caller

        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        code = ("import sys; from elastictk.supervisor.forkserver import serve; "
                "serve(int(sys.argv[1]), sys.argv[3:], sys.argv[2] or None)")
        why_not = can_fork() if fork else "not asked to"
        try:
            if why_not is None:
                ctl, preload, job = theirs.fileno(), self.preload, self.job
                self._proc = fork_server(lambda: serve(ctl, preload, job), ctl, mine.fileno())
                self.how = "forked"
            else:
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", code, str(theirs.fileno()), self.job or "", *self.preload],
                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True,
                    start_new_session=True,
                    preexec_fn=dies_with_caller(),
                )
                self.how = f"a fresh interpreter ({why_not})"
        finally:
            theirs.close()
        claim_child(self._proc.pid)  # its owner waits for it, never the orphan sweep
        self._sock = mine

    def wait_ready(self, timeout: Optional[float] = None) -> dict[str, Any]:
        """Block until the preload finished; its report (seconds, modules that failed)."""
        if self._ready is not None:
            return self._ready
        self.start()
        assert self._sock is not None
        limit = self.ready_timeout if timeout is None else timeout
        ready = readable([self._sock], limit)
        if not ready:
            raise ForkServerError(f"fork server did not finish preloading {self.preload} in {limit:.0f}s")
        try:
            header, _, _ = _recv_frame(self._sock)
        except (EOFError, OSError):
            code = self._proc.wait(5) if self._proc else None
            raise ForkServerError(f"fork server exited while preloading (exit code {code}); "
                                  "see its stderr above") from None
        self._ready = header
        return header

    def spawn(self, header: dict[str, Any], fds: Mapping[str, int], payload: bytes = b"", *,
              standby: bool = False) -> int:
        """Start one worker; its pid. ``fds`` maps stdout/stderr/status/result to fds.
        ``standby``: promote the standby, if the server holds one, instead of forking
        (:attr:`last_from_standby` says which it was)."""
        names = [n for n in _FD_NAMES if n in fds]
        header = dict(header, fds=names, payload_len=len(payload), standby=standby)
        reply = self._request(header, payload, [fds[n] for n in names], "start the worker")
        self.last_from_standby = bool(reply.get("standby"))
        return int(reply["pid"])

    def keep_standby(self, recipe: Mapping[str, Any], delay: float = STANDBY_DELAY) -> None:
        """Keep one standby from now on, forked ``delay`` seconds from now and again after
        each promotion. ``recipe``: ``cwd`` and, for the prewarm, the script (``kind``,
        ``target``)."""
        self._request({"op": "keep_standby", "recipe": dict(recipe), "delay": delay}, b"", [],
                      "keep a standby")

    def drop_standby(self) -> None:
        """Stop keeping a standby and kill the one there is (the server is shared)."""
        if self._sock is not None and self._ready is not None:
            self._request({"op": "drop_standby"}, b"", [], "drop its standby")

    def standby_pid(self) -> Optional[int]:
        """The standby's pid now; None while there is none (not asked, or not forked yet)."""
        pid = self._request({"op": "standby_pid"}, b"", [], "name its standby").get("pid")
        return None if pid is None else int(pid)

    def _request(self, header: dict[str, Any], payload: bytes, fds: Sequence[int],
                 what: str) -> dict[str, Any]:
        self.wait_ready()
        assert self._sock is not None
        self._sock.settimeout(self.request_timeout)
        try:
            _send_frame(self._sock, header, payload, fds)
            reply, _, _ = _recv_frame(self._sock)
        except (EOFError, OSError) as e:
            raise ForkServerError(f"fork server did not {what}: {e}") from None
        finally:
            self._sock.settimeout(None)
        return reply

    def close(self, timeout: float = 10.0) -> None:
        """Shut the server down (it kills any child still running) and reap it; one still
        importing has no children and would only make the caller wait: it is killed."""
        sock, self._sock = self._sock, None
        proc, self._proc = self._proc, None
        ready, self._ready = self._ready, None
        if proc is not None and ready is None and proc.poll() is None:
            proc.kill()
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if proc is not None:
            from ..lifetime.reaper import release_child

            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
            release_child(proc.pid)

    def __enter__(self) -> "PreloadServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_status(fd: int) -> Optional[int]:
    """The return code on a worker's status pipe; None if the server closed it without one."""
    data = b""
    while len(data) < _STATUS.size:
        chunk = os.read(fd, _STATUS.size - len(data))
        if not chunk:
            return None
        data += chunk
    return _STATUS.unpack(data)[0]

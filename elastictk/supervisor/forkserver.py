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
pipe, so the agent learns of the exit by ``select`` on that pipe without being its parent.

Caveat: preloaded modules were imported with the server's environment, so a module that reads
an environment variable at import time sees the agent's value, not the worker's.
"""
from __future__ import annotations

import json
import os
import pickle
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any, Mapping, Optional, Sequence

DEFAULT_PRELOAD = ("torch", "torch.optim", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
                   "elastictk.inplace.loop", "elastictk.faults")  # what replacement workers import
_LEN = struct.Struct("!I")
_STATUS = struct.Struct("!i")
_FD_NAMES = ("stdout", "stderr", "status", "result")


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
    from .child import become_worker, call_function, close_fds_except, finish_interpreter, run_python

    code = 1
    try:
        ctl.detach()  # the fd closes below; the socket object must not close a reused number
        status = fds.pop("status")
        os.close(status)
        close_fds_except(fds.values())
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(header["cwd"])
        become_worker(env=header["env"], stdout_fd=fds.get("stdout"), stderr_fd=fds.get("stderr"),
                      parent_pid=server_pid, death_signal=int(header["death_signal"]))
        if header["kind"] == "function":
            sys.path[:] = header["sys_path"]
            fn, args = pickle.loads(payload)
            code = call_function(fn, tuple(args), fds["result"])
        else:
            code = run_python(header["kind"], header["target"], header["args"])
    except BaseException:  # noqa: BLE001 - the worker must exit, never return into the server
        import traceback

        traceback.print_exc()
    finally:
        finish_interpreter(code)


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


def serve(ctl_fd: int, preload: Sequence[str]) -> None:
    """The server's main loop: preload, report ready, fork on request, report exits."""
    ctl = socket.socket(fileno=ctl_fd)
    server_pid = os.getpid()
    t0 = time.monotonic()
    failed: dict[str, str] = {}
    for name in preload:
        try:
            __import__(name)
        except Exception as e:  # noqa: BLE001 - a missing optional module only costs speed
            failed[name] = f"{type(e).__name__}: {e}"
    _warm()
    _send_frame(ctl, {"ready": True, "seconds": time.monotonic() - t0, "failed": failed})

    sel = selectors.DefaultSelector()
    sel.register(ctl, selectors.EVENT_READ, None)
    status_fds: dict[int, int] = {}  # child pid -> status pipe write end
    while True:
        for key, _ in sel.select():
            if key.data is None:
                try:
                    header, payload, raw = _recv_frame(ctl, maxfds=len(_FD_NAMES))
                except (EOFError, OSError):
                    for pid in status_fds:  # owner gone: its workers go too
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except OSError:
                            pass
                    os._exit(0)
                fds = dict(zip(header["fds"], raw))
                pid = os.fork()
                if pid == 0:
                    _child(ctl, header, payload, fds, server_pid)
                for fd in fds.values():
                    if fd != fds["status"]:
                        os.close(fd)
                status_fds[pid] = fds["status"]
                sel.register(os.pidfd_open(pid), selectors.EVENT_READ, pid)
                _send_frame(ctl, {"pid": pid})
            else:
                pid = key.data
                sel.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                fd = status_fds.pop(pid)
                try:
                    os.write(fd, _STATUS.pack(os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
                os.close(fd)


# -- owner side --------------------------------------------------------------------------------

class PreloadServer:
    """Owner of one fork server process. ``start`` returns at once (the import runs in the
    background, e.g. during rendezvous); ``spawn`` waits for it to be ready."""

    def __init__(self, preload: Sequence[str] = DEFAULT_PRELOAD, *,
                 ready_timeout: float = 300.0, request_timeout: float = 30.0) -> None:
        self.preload = tuple(preload)
        self.ready_timeout = ready_timeout
        self.request_timeout = request_timeout
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._sock: Optional[socket.socket] = None
        self._ready: Optional[dict[str, Any]] = None

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc else None

    def fileno(self) -> Optional[int]:
        """The owner's end of the control socket (a fork-started worker must close it)."""
        return self._sock.fileno() if self._sock is not None else None

    def start(self) -> None:
        if self._proc is not None:
            return
        from .reaper import dies_with_caller

        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        code = ("import sys; from elastictk.supervisor.forkserver import serve; "
                "serve(int(sys.argv[1]), sys.argv[2:])")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", code, str(theirs.fileno()), *self.preload],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True,
                start_new_session=True,
                preexec_fn=dies_with_caller(),
            )
        finally:
            theirs.close()
        self._sock = mine

    def wait_ready(self, timeout: Optional[float] = None) -> dict[str, Any]:
        """Block until the preload finished; its report (seconds, modules that failed)."""
        if self._ready is not None:
            return self._ready
        self.start()
        assert self._sock is not None
        limit = self.ready_timeout if timeout is None else timeout
        ready, _, _ = select.select([self._sock], [], [], limit)
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

    def spawn(self, header: dict[str, Any], fds: Mapping[str, int], payload: bytes = b"") -> int:
        """Start one worker; its pid. ``fds`` maps stdout/stderr/status/result to fds."""
        self.wait_ready()
        assert self._sock is not None
        names = [n for n in _FD_NAMES if n in fds]
        header = dict(header, fds=names, payload_len=len(payload))
        self._sock.settimeout(self.request_timeout)
        try:
            _send_frame(self._sock, header, payload, [fds[n] for n in names])
            reply, _, _ = _recv_frame(self._sock)
        except (EOFError, OSError) as e:
            raise ForkServerError(f"fork server did not start the worker: {e}") from None
        finally:
            self._sock.settimeout(None)
        return int(reply["pid"])

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
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)

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

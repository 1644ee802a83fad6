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

import os
import socket
import subprocess
import sys
from typing import Any, Mapping, Optional, Sequence

from ..lifetime.ready import readable
from .forkloop import STANDBY_DELAY, serve
from .forkstart import ForkedChild, can_fork, fork_server
from .forkwire import FD_NAMES, recv_frame, send_frame

__all__ = ["DEFAULT_PRELOAD", "ForkServerError", "PreloadServer"]

DEFAULT_PRELOAD = ("torch", "torch.optim", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
                   "elastictk.inplace.loop", "elastictk.faults")  # what replacement workers import


class ForkServerError(RuntimeError):
    """The fork server could not start or could not start a worker; the message says why."""


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
        code = ("import sys; from elastictk.supervisor.forkloop import serve; "
                "serve(int(sys.argv[1]), sys.argv[3:], sys.argv[2] or None)")
        why_not = can_fork() if fork else "not asked to"
        try:
            if why_not is None:
                ctl, preload, job = theirs.fileno(), self.preload, self.job
                self._proc = fork_server(lambda: serve(ctl, preload, job), ctl, mine.fileno())
                self.how = "forked"
            else:
                from .env import WITHHELD

                self._proc = subprocess.Popen(  # workers fork from it: no secret of ours in its env
                    [sys.executable, "-c", code, str(theirs.fileno()), self.job or "", *self.preload],
                    env={k: v for k, v in os.environ.items() if k not in WITHHELD},
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
            header, _, _ = recv_frame(self._sock)
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
        names = [n for n in FD_NAMES if n in fds]
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
            send_frame(self._sock, header, payload, fds)
            reply, _, _ = recv_frame(self._sock)
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

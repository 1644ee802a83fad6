"""K node processes forked for one rendezvous round: set up apart, started together, reaped.

A rendezvous benchmark needs real processes (threads would measure the GIL), and hundreds of
them: importing torch in each would take minutes on a small machine. So the benchmark process
imports everything once and *forks* the nodes (copy-on-write; ``gc.freeze`` keeps the garbage
collector from touching, and so copying, the inherited heap). Forking is only safe while this
process runs no threads of its own and holds no sockets the children would share, which is why
the store server of a round lives in a forked process of its own, too.

One round, step by step:

1. fork a server process; it starts the store server and reports its port over a pipe;
2. fork K node processes; each connects its own client and builds its handler (not timed),
   reports "ready", and blocks on the start pipe;
3. once all K are ready, this process notes the time and closes the start pipe: every node
   sees end-of-file at the same moment and joins the round;
4. each node reports its rank and the monotonic time it got it (``CLOCK_MONOTONIC`` is one
   clock for every process on the host), then waits for the finish pipe, so the early finishers
   neither exit nor stop heartbeating while the others still work;
5. this process closes the finish pipe and reaps every node and the server by PID, SIGKILLing
   whatever has not exited in time. A round that does not finish in time is cut off the same way.

Every message is one JSON line written with a single ``os.write`` of less than ``PIPE_BUF``
bytes, so the lines of K writers never interleave on the shared pipe.
"""
from __future__ import annotations

import gc
import json
import os
import select
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from elastictk.lifetime.reaper import die_with_parent

from .common import BenchError

_MAX_LINE = 3000  # below PIPE_BUF (4096): one write, never interleaved


class Node(Protocol):
    """One simulated node, built in its own process before the start signal."""

    def join(self) -> dict[str, Any]:
        """Join the round; what the node got (rank, world_size, ...), as JSON-able data."""

    def close(self) -> None:
        """Leave and release what the node holds."""


NodeFactory = Callable[[int, int], Node]  # (store port, node index) -> Node; runs in the child
ServerFactory = Callable[[], tuple[int, object]]  # () -> (port, server); runs in the child


@dataclass
class RoundRun:
    """What one round of K forked nodes did.

    ``results`` holds one report per node that got its rank (index order); ``elapsed`` is the
    time from the start signal until the last of them got it, or the cap when ``timed_out``.
    """

    k: int
    results: list[dict[str, Any]]
    elapsed: float
    timed_out: bool
    setup_s: float
    pids: list[int] = field(default_factory=list)

    @property
    def first(self) -> float:
        return min((r["t"] for r in self.results), default=self.elapsed)


def run_round(
    k: int,
    server: ServerFactory,
    node: NodeFactory,
    setup_timeout: float,
    round_timeout: float,
) -> RoundRun:
    """Fork a server and ``k`` nodes, start them together, collect every rank, reap them all.

    Raises :class:`BenchError` when a node fails or dies; a round still running after
    ``round_timeout`` seconds is stopped and returned with ``timed_out=True``.
    """
    pids: list[int] = []
    nodes: list[int] = []
    own: list[int] = []  # this process's pipe ends: closed in every child and at the end
    graceful = False  # whether the nodes may leave on their own, or are SIGKILLed
    t_setup = time.monotonic()
    srv_pid, port, stop_w = _start_server(server, setup_timeout)
    pids.append(srv_pid)
    inbox: _Inbox | None = None
    try:
        msg_r, msg_w = os.pipe()
        start_r, start_w = os.pipe()
        finish_r, finish_w = os.pipe()
        own += [msg_r, start_w, finish_w]
        gc.freeze()  # move the heap out of the collector's sight: forked pages stay shared
        try:
            for i in range(k):
                pid = os.fork()
                if pid == 0:  # pragma: no cover - the child never returns from here
                    code = 1
                    try:
                        for fd in own + [stop_w]:
                            os.close(fd)
                        code = _node_main(node, port, i, msg_w, start_r, finish_r,
                                          setup_timeout + round_timeout + 60)
                    finally:
                        os._exit(code)
                nodes.append(pid)
                pids.append(pid)
        finally:
            gc.unfreeze()
            for fd in (msg_w, start_r, finish_r):
                os.close(fd)
        inbox = _Inbox(msg_r, nodes)
        if len(inbox.collect("ready", k, setup_timeout)) < k:
            raise BenchError(f"only {len(inbox.got['ready'])} of {k} nodes were set up "
                             f"within {setup_timeout:g}s")
        setup_s = time.monotonic() - t_setup
        start = time.monotonic()
        os.close(start_w)
        own.remove(start_w)
        done = inbox.collect("done", k, round_timeout)
        timed_out = len(done) < k
        graceful = not timed_out
        elapsed = round_timeout if timed_out else max(r["t"] for r in done.values()) - start
        results = [{**r, "t": r["t"] - start} for _, r in sorted(done.items())]
        return RoundRun(k, results, elapsed, timed_out, setup_s, pids)
    finally:
        try:
            if inbox is not None:
                inbox.close()
            if not graceful:
                _kill(nodes)
            for fd in own:
                os.close(fd)  # the finish pipe: the nodes leave and exit
            _reap(nodes, 30.0)
        finally:
            os.close(stop_w)  # the server exits once its nodes are gone
            _reap([srv_pid], 10.0)


# -- in the children ---------------------------------------------------------------------------
def _send(fd: int, msg: dict[str, Any]) -> None:
    data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
    if len(data) > _MAX_LINE:
        data = (json.dumps({"i": msg.get("i"), "kind": "error",
                            "error": f"report of {len(data)} bytes is too long"}) + "\n").encode()
    os.write(fd, data)


def _wait_eof(fd: int, timeout: float) -> bool:
    """Block until the other side closes ``fd``'s pipe, at most ``timeout`` seconds."""
    readable, _, _ = select.select([fd], [], [], timeout)
    return bool(readable) and os.read(fd, 1) == b""


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:500]


def _quiet() -> None:
    """Send the child's stdout and stderr to /dev/null: hundreds of nodes logging the same
    c10d warning would bury the report, and a node's failure comes back over the pipe."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)


def _node_main(
    factory: NodeFactory, port: int, i: int, msg_w: int, start_r: int, finish_r: int,
    timeout: float,
) -> int:
    die_with_parent(os.getppid(), signal.SIGKILL)
    _quiet()
    node: Node | None = None
    try:
        node = factory(port, i)
        _send(msg_w, {"i": i, "kind": "ready"})
        if not _wait_eof(start_r, timeout):
            return 1
        got = node.join()
        _send(msg_w, {"i": i, "kind": "done", "t": time.monotonic(), **got})
    except BaseException as e:  # reported to the benchmark process, which raises it there
        _send(msg_w, {"i": i, "kind": "error", "error": _one_line(e)})
        return 1
    _wait_eof(finish_r, timeout)
    try:
        node.close()
    except BaseException:
        pass
    return 0


def _start_server(factory: ServerFactory, timeout: float) -> tuple[int, int, int]:
    """Fork the store server's process; its PID, its port, and the pipe that stops it."""
    port_r, port_w = os.pipe()
    stop_r, stop_w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns from here
        code = 1
        try:
            os.close(port_r)
            os.close(stop_w)
            die_with_parent(parent, signal.SIGKILL)
            _quiet()
            port, _server = factory()
            os.write(port_w, f"{port}\n".encode())
            _wait_eof(stop_r, 24 * 3600)
            code = 0
        finally:
            os._exit(code)
    os.close(port_w)
    os.close(stop_r)
    try:
        readable, _, _ = select.select([port_r], [], [], timeout)
        line = os.read(port_r, 64).decode().strip() if readable else ""
    finally:
        os.close(port_r)
    if not line.isdigit():
        os.close(stop_w)
        _reap([pid], 10.0)
        raise BenchError(f"the store server process did not report its port within {timeout:g}s")
    return pid, int(line), stop_w


# -- in the benchmark process ------------------------------------------------------------------
class _Inbox:
    """Reads the nodes' JSON lines; notices at once a node that died without a word."""

    def __init__(self, fd: int, pids: list[int]) -> None:
        self.fd = fd
        self.buf = b""
        self.pidfds: dict[int, int] = {}  # pidfd -> node index
        self.got: dict[str, dict[int, dict[str, Any]]] = {"ready": {}, "done": {}}
        self.exited: set[int] = set()
        try:
            for i, pid in enumerate(pids):
                self.pidfds[os.pidfd_open(pid)] = i
        except BaseException:
            self.close()
            raise

    def collect(self, kind: str, want: int, timeout: float) -> dict[int, dict[str, Any]]:
        """Messages of ``kind`` by node index, until ``want`` came or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        for pfd, i in self.pidfds.items():
            if i not in self.exited:
                poller.register(pfd, select.POLLIN)
        while len(self.got[kind]) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for fd, _ in poller.poll(left * 1000):
                if fd != self.fd:
                    poller.unregister(fd)
                    self.exited.add(self.pidfds[fd])
            self._read()  # before judging an exit: its last words are in the pipe by now
            early = self.exited - set(self.got["done"])
            if early:
                raise BenchError(f"node {min(early)} exited before it got a rank")
        return self.got[kind]

    def _read(self) -> None:
        while select.select([self.fd], [], [], 0)[0]:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                break
            self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            msg = json.loads(line)
            if msg["kind"] == "error":
                raise BenchError(f"node {msg['i']}: {msg['error']}")
            self.got[msg["kind"]][msg["i"]] = msg

    def close(self) -> None:
        for pfd in self.pidfds:
            os.close(pfd)
        self.pidfds.clear()


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)  # our own child, by PID
        except ProcessLookupError:
            pass


def _reap(pids: list[int], timeout: float) -> None:
    """Wait for ``pids`` (children of this process) to exit; SIGKILL those that do not."""
    left = _wait_exit(pids, timeout)
    _kill(left)
    still = _wait_exit(left, 10.0)
    if still:
        raise BenchError(f"{len(still)} node process(es) survived SIGKILL: {still[:5]}")


def _wait_exit(pids: list[int], timeout: float) -> list[int]:
    """Reap what exits within ``timeout`` (event-driven, through pidfds); the rest's PIDs."""
    deadline = time.monotonic() + timeout
    fds: dict[int, int] = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            pass  # already reaped
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    left = set(fds.values())
    try:
        while left:
            wait_ms = max(0.0, deadline - time.monotonic()) * 1000
            ready = poller.poll(wait_ms)
            if not ready:
                break
            for fd, _ in ready:
                poller.unregister(fd)
                pid = fds[fd]
                os.waitpid(pid, 0)  # it has exited: returns at once
                left.discard(pid)
    finally:
        for fd in fds:
            os.close(fd)
    return sorted(left)

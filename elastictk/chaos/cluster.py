"""The processes of a multi-node chaos run: N ``elastictk-run`` agents on loopback and, for the
etcd backend, the etcd server they share. This module owns them and nothing else does.

Why a class of its own: a single-node run is one child, but a multi-node run is a small cluster
whose members die and come back on purpose (``kill-agent``, ``--rejoin``) and whose store is
stopped on purpose (``store-outage``). Keeping the PIDs, the per-node event logs and the store
in one owner makes "only processes of the job are touched" and "nothing outlives the run" one
place to read.

Node ``i`` is the ``i``-th agent started; faults sent from here (``kill-agent on node:N``, a
signal to ``node:N``'s workers) mean that agent. Its group rank is whatever the rendezvous gave
it (arrival order; survivors keep theirs), and a step fault aimed at ``node:N`` fires inside the
workers of group rank N. Under c10d, node 0 hosts the store: it is started first and the others
once it announced its rendezvous (``rendezvous_started``, logged after the store is bound);
losing it ends the job, and its ``store-outage`` is a SIGSTOP of that agent.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from ..metrics.events import read_events
from ..store import quiet_port
from ..lifetime.reaper import dies_with_caller

BACKENDS = ("c10d", "etcd")
PORT_TRIES = 3  # node 0's starts on a fresh free port, under c10d (see Cluster._host_c10d)


@dataclass
class Incarnation:
    """One agent process of a node (a rejoined node has a second one)."""

    node: int
    number: int
    proc: subprocess.Popen[str]
    events: Path
    started: float
    killed: bool = False
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid


class Cluster:
    """Start, fault and reap the agents of one multi-node job."""

    def __init__(self, nodes: int, backend: str, launcher_flags: Sequence[str],
                 command: Sequence[str], out_dir: Path, env: dict[str, str], *, tag: str,
                 on_line: Any = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: use one of {', '.join(BACKENDS)}")
        self.nodes, self.backend, self.flags = nodes, backend, list(launcher_flags)
        self.command, self.out, self.env, self.tag = list(command), out_dir, env, tag
        self.on_line = on_line  # called with each stdout line (step counting)
        self.run_id = f"chaos-{tag}-{uuid.uuid4().hex[:8]}"
        self.etcd: Any = None
        self.endpoint = ""
        self.incarnations: list[Incarnation] = []
        self.store_paused = False
        self.retries: list[str] = []  # node-0 starts dropped because their port was taken

    # -- start ---------------------------------------------------------------------------------
    def start(self, ready_timeout: float = 60.0) -> None:
        """Start the store (etcd) and the agents, in index order."""
        if self.backend == "etcd":
            from ..testing.etcd import EtcdServer

            self.etcd = EtcdServer(base_dir=self.out).start()
            self.endpoint = self.etcd.endpoint
            self.spawn(0)
        else:
            self._host_c10d(ready_timeout)
        for i in range(1, self.nodes):
            self.spawn(i)

    def _host_c10d(self, ready_timeout: float) -> None:
        """Start node 0 on a free port, where it hosts the store, and wait for its rendezvous.

        A free port is only free when it is picked: until node 0 binds it (its interpreter
        starts first, seconds on a loaded host) another process may take it (rarely below the
        ephemeral range, where :func:`quiet_port` picks, but not never). Node 0 then
        finds no TCPStore there and exits (exit 2, naming the endpoint), and the next node,
        once the port was freed again, would host a smaller job in its place. So such a node 0
        is dropped, its lines kept in :attr:`retries`, and started again on another port."""
        for attempt in range(PORT_TRIES):
            self.endpoint = f"127.0.0.1:{quiet_port('127.0.0.1')}"
            first = self.spawn(0)
            self._await_rendezvous(first, ready_timeout)
            if attempt + 1 == PORT_TRIES or not self._lost_its_port(first):
                return
            self.incarnations.remove(first)
            self.retries.append(f"node 0 could not host the store at {self.endpoint} (the port was "
                                f"taken after it was picked); started again on another port: "
                                + "".join(first.err).strip()[-300:])

    def _lost_its_port(self, inc: Incarnation) -> bool:
        """Whether ``inc`` exited at its start because something else answered at the endpoint."""
        if inc.proc.poll() is None or inc.proc.returncode != 2:
            return False
        for t in inc.readers:
            t.join(10)
        return f"cannot reach the TCPStore at {self.endpoint}" in "".join(inc.err)

    def argv(self, node: int, events: Path) -> list[str]:
        """Node ``node``'s ``python -m elastictk.run`` command line (the flags name the backend)."""
        logs = self.out / f"{self.tag}-logs" / f"node{node}"
        return [sys.executable, "-m", "elastictk.run", *self.flags,
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id,
                "--event-log", str(events), "--log-dir", str(logs), *self.command]

    def spawn(self, node: int) -> Incarnation:
        """Start (or, after a kill, restart) node ``node``'s agent."""
        number = sum(1 for x in self.incarnations if x.node == node)
        suffix = "" if number == 0 else f".{number}"
        events = self.out / f"{self.tag}-node{node}{suffix}-events.jsonl"
        events.unlink(missing_ok=True)
        # The agents die with this process (PR_SET_PDEATHSIG), as workers die with their agent:
        # a chaos run killed by its caller leaves no cluster behind.
        proc = subprocess.Popen(self.argv(node, events), env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=dies_with_caller())
        inc = Incarnation(node, number, proc, events, time.monotonic())
        inc.readers = [threading.Thread(target=self._read, args=(proc.stdout, inc.out, True), daemon=True),
                       threading.Thread(target=self._read, args=(proc.stderr, inc.err, False), daemon=True)]
        for t in inc.readers:
            t.start()
        self.incarnations.append(inc)
        return inc

    def _read(self, stream: Any, sink: list[str], steps: bool) -> None:
        for line in iter(stream.readline, ""):
            sink.append(line)
            if steps and self.on_line is not None:
                self.on_line(line)

    def _await_rendezvous(self, inc: Incarnation, timeout: float) -> None:
        """Until the agent announced its rendezvous (so the next one arrives after it), it
        exited, or ``timeout``; a slow start is not an error here, the job will show it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and inc.proc.poll() is None:
            if inc.events.exists() and any(e.kind == "rendezvous_started" for e in read_events(inc.events)):
                return
            time.sleep(0.02)

    # -- questions -----------------------------------------------------------------------------
    def current(self, node: int) -> Optional[Incarnation]:
        """The latest agent of ``node``."""
        found = [x for x in self.incarnations if x.node == node]
        return found[-1] if found else None

    def pids(self) -> set[int]:
        out = {x.pid for x in self.incarnations}
        if self.etcd is not None and self.etcd.pid is not None:
            out.add(self.etcd.pid)
        return out

    def running(self) -> bool:
        return any(x.proc.poll() is None for x in self.incarnations)

    def exit_code(self) -> Optional[int]:
        """The job's exit code: 0 when every agent the run did not kill exited 0, else the first
        other code of those agents (the latest incarnation of each node counts)."""
        codes = []
        for n in range(self.nodes):
            inc = self.current(n)
            if inc is not None and not inc.killed:
                codes.append(inc.proc.returncode)
        if any(c is None for c in codes):
            return None
        bad = [c for c in codes if c != 0]
        return bad[0] if bad else (0 if codes else 1)

    # -- faults --------------------------------------------------------------------------------
    def kill_agent(self, node: int) -> Optional[int]:
        """SIGKILL node ``node``'s running agent (its workers die with it by their death
        signal); the PID, or None when that node runs no agent now."""
        inc = self.current(node)
        # Killed already (its rejoin still to come): a second kill would fire at nothing, and
        # schedule a second rejoin, one node more than the job has.
        if inc is None or inc.killed or inc.proc.poll() is not None:
            return None
        if self.backend == "c10d" and node == 0 and self.store_paused:
            self.resume_store()
        inc.proc.send_signal(signal.SIGKILL)
        inc.killed = True
        return inc.pid

    def store_pid(self) -> Optional[int]:
        """The process that serves the store: etcd, or the agent of node 0 under c10d."""
        if self.etcd is not None:
            return self.etcd.pid
        inc = self.current(0)
        return inc.pid if inc is not None and inc.proc.poll() is None and inc.number == 0 else None

    def pause_store(self) -> Optional[int]:
        """SIGSTOP the store's process: it keeps its sockets and answers nothing. Under c10d
        that is node 0's agent (its workers keep running; their own collectives do not use the
        rendezvous store). The PID stopped, or None when there is none to stop."""
        pid = self.store_pid()
        if pid is None:
            return None
        os.kill(pid, signal.SIGSTOP)
        self.store_paused = True
        return pid

    def resume_store(self) -> None:
        if not self.store_paused:
            return
        self.store_paused = False
        pid = self.store_pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    # -- end -----------------------------------------------------------------------------------
    def terminate(self, grace: float = 30.0) -> None:
        """SIGTERM every running agent (the timeout), SIGKILL what is left after ``grace``."""
        self.resume_store()
        for x in self.incarnations:
            if x.proc.poll() is None:
                x.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for x in self.incarnations:
            try:
                x.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                x.proc.kill()

    def close(self) -> None:
        """Reap every agent and the store; idempotent."""
        self.resume_store()
        for x in self.incarnations:
            if x.proc.poll() is None:
                x.proc.kill()
            x.proc.wait()
            for t in x.readers:
                t.join(10)
        if self.etcd is not None:
            self.etcd.close()

    def stdout(self) -> str:
        return "".join(line for x in self.incarnations for line in x.out)

    def stderr(self) -> str:
        """Every agent's stderr, each block headed by its node."""
        return "".join(f"=== node {x.node} (agent {x.number}, pid {x.pid}, exit {x.proc.returncode}) ===\n"
                       + "".join(x.err) for x in self.incarnations)

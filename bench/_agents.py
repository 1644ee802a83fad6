"""Agents of one job that a node-loss benchmark starts, watched through the workers' steps log.

``multinode.py`` (test hosts in network namespaces) and ``spares.py`` (agents on loopback)
measure the same thing from the same evidence: launcher agents running
``bench/_multinode_worker.py`` (a gloo all-reduce per step, one line per step in
``steps.log``: monotonic time, world size, rank, pid), one agent SIGKILLed with every process
under it, and the time until every rank of the job formed after it has logged a step. What
they share is here, so each says only how its nodes are laid out: the launchers' command line
and the budget both get to notice a silent node, reading the steps log, polling for a
condition, killing one agent's tree, and reaping every PID started.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Collection, Optional

from .common import BenchError, kill_tree

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "bench" / "_multinode_worker.py")
# The same budget to notice a silent node: elastictk's heartbeats against torchrun's keep-alives.
ELASTICTK_CONF = "last_call_timeout=1,heartbeat_interval=0.2,heartbeat_timeout=2,join_timeout=60"
TORCH_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=60"


def agent_argv(launcher: str, common: list[str], out: Path, torch_conf: str = TORCH_CONF) -> list[str]:
    """One agent's command line: ``common`` flags, then each launcher's own and the worker."""
    if launcher == "elastictk":
        return [sys.executable, "-m", "elastictk.run", *common, "--rdzv-conf", ELASTICTK_CONF,
                "--shutdown-timeout", "2", WORKER, str(out)]
    return [sys.executable, "-m", "torch.distributed.run", *common, "--rdzv-conf", torch_conf,
            "--monitor-interval", "0.1", WORKER, str(out)]


class Agents:
    """The agents of one job, writing into ``out``: steps read back, one agent killed, all reaped."""

    def __init__(self, launcher: str, out: Path) -> None:
        self.launcher, self.out = launcher, out
        self.agents: list[subprocess.Popen[Any]] = []
        self.pids: list[int] = []

    def steps(self) -> list[tuple[float, int, int, int]]:
        """Every step logged so far: (monotonic time, world size, rank, pid)."""
        path = self.out / "steps.log"
        out = []
        for line in path.read_text().splitlines() if path.exists() else []:
            parts = line.split()
            if len(parts) == 4:
                out.append((float(parts[0]), int(parts[1]), int(parts[2]), int(parts[3])))
        return out

    def stepping(self, world: int, after: float, old: Collection[int] = ()) -> Optional[float]:
        """When every rank of a ``world``-rank job had logged a step after ``after`` from a
        process not in ``old``; None until then."""
        first: dict[int, float] = {}
        for t, w, r, pid in self.steps():
            if w == world and t > after and pid not in old and r not in first:
                first[r] = t
        return max(first.values()) if len(first) == world else None

    def logged(self, i: int, marker: str) -> Optional[float]:
        """Now, once agent ``i``'s log holds ``marker``; else None."""
        path = self.out / f"agent{i}.log"
        return time.monotonic() if path.exists() and marker in path.read_text(errors="replace") else None

    def wait(self, what: str, pred: Callable[[], Optional[float]], timeout: float) -> float:
        """What ``pred`` returns once it is not None; BenchError naming ``what`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = pred()
            if got is not None:
                return got
            time.sleep(0.05)
        raise BenchError(f"{self.launcher}: {what} not within {timeout:g}s; {self.tail()}")

    def tail(self) -> str:
        raise NotImplementedError

    def kill(self, i: int) -> float:
        """SIGKILL agent ``i`` and every process under it at once; the kill's monotonic time."""
        t, pids = kill_tree(self.agents[i].pid)
        self.pids += pids
        return t

    def close(self) -> list[int]:
        """Kill what is left (by PID, trees first) and return every PID this run started."""
        for a in self.agents:
            self.pids += kill_tree(a.pid)[1]
            a.wait()
        return self.pids + [a.pid for a in self.agents]

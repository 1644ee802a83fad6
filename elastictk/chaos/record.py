"""What one chaos run recorded: the faults that fired (:class:`Injection`), and the run's whole
record (:class:`RunRecord`) with the workers' own lines read back from their fault log.

Apart from the runner that fills it (``runner.py``, ``multinode.py``): the report, the timeline
and the tests read a record, often one built by hand, without the subprocesses and signals that
make one. The fault log is written by the workers, so it is parsed as bytes from outside
(``_safejson``): a line that does not parse is skipped, never an error.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .._safejson import loads as safe_loads

CHECKSUM_LINE = re.compile(r"final checksum (\S+)")


@dataclass
class Injection:
    """A fault that actually fired: from the worker's fault log or from the outside injector."""

    fault: int
    kind: str
    target: str
    mono: float
    pid: Optional[int]
    step: Optional[int] = None
    how: str = "inside"  # inside (the worker's own checkpoint) | outside (a signal from here)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class RunRecord:
    """Everything the report needs, in monotonic seconds of this host."""

    argv: list[str]
    started: float
    ended: float = 0.0
    exit_code: Optional[int] = None
    stdout: str = ""
    stderr: str = ""
    injections: list[Injection] = field(default_factory=list)
    progress: list[dict[str, Any]] = field(default_factory=list)  # the workers' progress lines
    fault_lines: list[dict[str, Any]] = field(default_factory=list)  # the fault log's lines of fired faults
    restored: list[dict[str, Any]] = field(default_factory=list)  # State.restore()'s lines (chaos/lost.py)
    data: list[dict[str, Any]] = field(default_factory=list)  # batches trained (data/record.py, chaos/samples.py)
    ranks_seen: set[int] = field(default_factory=set)  # global ranks that ever had a worker
    unfired: dict[int, str] = field(default_factory=dict)  # fault index -> why the runner did not inject it
    stopped: str = ""  # "timeout" or a signal name when the run was stopped
    events: list[Any] = field(default_factory=list)
    pids: set[int] = field(default_factory=set)
    # (mono, step) of "step N" lines as they arrived: the live progress display only, never a verdict
    steps: list[tuple[float, int]] = field(default_factory=list)
    leaked_processes: list[str] = field(default_factory=list)
    leaked_shm: list[str] = field(default_factory=list)
    leaked_ports: list[str] = field(default_factory=list)
    # multi-node runs (see .multinode): how many agents, over which store; every agent process
    # ({node, agent, pid, exit, killed}); (mono, node) of each rejoin
    nodes: int = 1
    backend: str = ""
    store_endpoint: str = ""
    agents: list[dict[str, Any]] = field(default_factory=list)
    rejoins: list[tuple[float, int]] = field(default_factory=list)
    store_retries: list[str] = field(default_factory=list)  # node 0 started again: its port was taken
    finished_somewhere: bool = False
    clock: Optional[float] = None  # when time faults start counting: workers first ran (every node's)

    @property
    def checksum(self) -> Optional[str]:
        found = CHECKSUM_LINE.findall(self.stdout)
        return found[-1] if found else None


def _fault_lines(fault_log: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if fault_log.exists():  # written by the workers: parsed as bytes from outside (_safejson)
        for line in fault_log.read_bytes().splitlines():
            try:
                d = safe_loads(line)
            except ValueError:
                continue
            if isinstance(d, dict):
                out.append(d)
    return out


def read_fault_log(fault_log: Path) -> list[Injection]:
    """The step faults the workers fired, from their fault log."""
    return [Injection(int(d["fault"]), str(d["kind"]), str(d["target"]), float(d["monotonic"]),
                      int(d["pid"]), d.get("step")) for d in _fault_lines(fault_log) if "fault" in d]


def read_progress(fault_log: Path) -> list[dict[str, Any]]:
    """The workers' ``progress`` lines (step source and step, at the first step and at exit)."""
    return [d for d in _fault_lines(fault_log) if "progress" in d]


def read_worker_records(rec: RunRecord, fault_log: Path) -> None:
    """The workers' own records from the fault log: progress, fired faults, restores."""
    lines = _fault_lines(fault_log)
    rec.progress = [d for d in lines if "progress" in d]
    rec.fault_lines = [d for d in lines if "fault" in d]
    rec.restored = [d for d in lines if "restored" in d]
    rec.data = [d for d in lines if "data" in d]

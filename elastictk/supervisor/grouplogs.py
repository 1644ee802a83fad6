"""``GroupLogs``: where one worker group's logs go, and the files and tee pumps it opens there.

Apart from ``group.py`` because it is the group's whole filesystem side: the log root (a kept
temp dir by default), the run directory claimed once per run id, one attempt directory per
attempt, a replacement's ``<tag>`` subdirectory, or wherever a ``--logs-specs`` class's ``reify``
says; then each rank's files (``open_rank_logs`` in elastictk's layout, ``logspecs`` in the
other) and environment, and the pumps that tee them to the console. The directory rules live in
``logs.py``; the group only says which ranks start when.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from .env import Assignment, worker_env
from .logpump import Console, LineFilter, LogPump, closed_on_error
from .logs import (
    FILE_FLAGS, FILE_MODE, RankLogs, claim_run_dir, line_prefix, make_attempt_dir, make_private_dir,
)
from .logspecs import Reified, open_reified_rank_logs, reified_filters, reify
from .spec import Std, WorkerSpec, std_for


class GroupLogs:
    """One group's log tree across attempts, and the open logs and pumps of the current one."""

    def __init__(self, spec: WorkerSpec, log_dir: Optional[Path],
                 console: tuple[Console, Console]) -> None:
        self.spec = spec
        self.log_dir = log_dir
        self.run_log_dir: Optional[Path] = None
        self.attempt_dir: Optional[Path] = None
        self._run_id: Optional[str] = None
        self._console = console
        self.ranks: dict[int, RankLogs] = {}
        self._pump: Optional[LogPump] = None
        self._pumps: list[LogPump] = []  # one per replacement worker (see respawn)

    def begin(self, attempt: int, assignment: Assignment) -> None:
        """The directories of a new ``attempt`` (elastictk's layout; under ``logs_specs`` its
        ``reify`` decides, at ``open``); forgets the last attempt's rank logs."""
        if self.spec.logs_specs is None:
            if self.log_dir is None:
                # Logs are the record of a failure: a default dir is created and deliberately kept.
                self.log_dir = Path(tempfile.mkdtemp(prefix="elastictk_"))
            if self.run_log_dir is None or assignment.run_id != self._run_id:
                self.run_log_dir = claim_run_dir(self.log_dir, assignment.run_id)
                self._run_id = assignment.run_id
            self.attempt_dir = make_attempt_dir(self.run_log_dir, attempt)
        self.ranks = {}

    def open(self, a: Assignment, ranks: Sequence[int], extra_env: dict[str, str],
             tag: Optional[str] = None) -> dict[int, dict[str, str]]:
        """Open the logs of ``ranks`` (all of an attempt's, or with ``tag`` one replacement's,
        under ``attempt_<n>/<tag>/``) and start their pump; returns their environments."""
        spec, replacement = self.spec, tag is not None
        where, dest = self.attempt_dir, None
        if spec.logs_specs is None and tag is not None:
            assert self.attempt_dir is not None
            where = self.attempt_dir / tag
            make_private_dir(where, exist_ok=True)
        if spec.logs_specs is not None:
            where, dest = None, reify_logs(spec, a)
            if not replacement:
                self.attempt_dir = dest.attempt_dir
                self.run_log_dir = dest.run_dir or Path(str(getattr(spec.logs_specs, "root_log_dir",
                                                                    os.devnull)))
        pump, envs = open_logs(spec, a, ranks, where=where, dest=dest, attempt_dir=self.attempt_dir,
                               console=self._console, extra_env=extra_env, into=self.ranks,
                               replacement=replacement)
        if replacement:
            self._pumps.append(pump)
        else:
            self._pump = pump
        pump.start()
        return envs

    def fds(self, exclude_rank: int) -> list[int]:
        """The agent's ends of every rank's logs but ``exclude_rank``'s, and the pumps' fds."""
        fds: list[int] = []
        for lr, logs in self.ranks.items():
            if lr != exclude_rank:
                fds += logs.owned_fds()
        for pump in ([self._pump] if self._pump is not None else []) + self._pumps:
            fds += pump.fds()
        return fds

    def close_pumps(self, drain: float) -> None:
        """Close the attempt's pumps, each waiting up to ``drain`` seconds for its pipes' EOF."""
        if self._pump is not None:
            self._pump.close(drain)
            self._pump = None
        for pump in self._pumps:
            pump.close(drain)
        self._pumps = []


def _env(spec: WorkerSpec, a: Assignment, lr: int, error_file: Optional[str],
         base: dict[str, str], extra: Optional[dict[str, str]]) -> dict[str, str]:
    return worker_env(a, role=spec.role, local_rank=lr, local_world_size=spec.local_world_size,
                      error_file=error_file, base_env=base, extra=extra,
                      virtual_local_rank=spec.virtual_local_rank)


def reify_logs(spec: WorkerSpec, a: Assignment) -> Reified:
    """Where the spec's ``logs_specs`` puts every local rank's logs: torch's ``reify`` sees
    torch's variables only, for every local rank, and may change them."""
    visible = {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES",) if k in os.environ}
    return reify(spec.logs_specs, {lr: _env(spec, a, lr, None, visible, None)
                                   for lr in range(spec.local_world_size)})


def open_logs(spec: WorkerSpec, a: Assignment, ranks: Sequence[int], *, where: Optional[Path],
              dest: Optional[Reified], attempt_dir: Optional[Path],
              console: tuple[Console, Console], extra_env: dict[str, str],
              into: dict[int, RankLogs], replacement: bool = False
              ) -> tuple[LogPump, dict[int, dict[str, str]]]:
    """Open the logs of ``ranks`` (into ``into``) under ``where`` in elastictk's layout, or at
    ``dest`` (``reify_logs``) under ``logs_specs``; returns their pump and their environments."""
    base, extra = dict(os.environ), {**spec.env, **extra_env}
    envs: dict[int, dict[str, str]] = {}
    if dest is None:
        assert where is not None and attempt_dir is not None
        pump = LogPump(*console, filters=line_filters(spec, attempt_dir))
        with closed_on_error(pump):
            for lr in ranks:
                logs = into[lr] = open_rank_logs(spec, where, lr, a.global_rank(lr), pump)
                envs[lr] = _env(spec, a, lr, logs.error_file, base, extra)
        return pump, envs
    pump = LogPump(*console, filters=reified_filters(spec, dest))
    with closed_on_error(pump):
        for lr in ranks:
            logs = into[lr] = open_reified_rank_logs(spec, dest, lr, a.global_rank(lr),
                                                     pump, append=replacement)
            envs[lr] = {**_env(spec, a, lr, logs.error_file, base, extra), **dest.env[lr]}
    return pump, envs


# -- elastictk's own layout: attempt_<n>/<local_rank>/{stdout,stderr}.log ---------------------

def line_filters(spec: WorkerSpec, attempt_dir: Path) -> "dict[Std, LineFilter]":
    """The spec's ``duplicate_*_filters`` as the files an attempt's pumps append matches to."""
    out: dict[Std, LineFilter] = {}
    for stream, name in ((Std.OUT, "stdout"), (Std.ERR, "stderr")):
        needles = getattr(spec, f"duplicate_{name}_filters")
        if needles:
            out[stream] = LineFilter(tuple(n.encode() for n in needles),
                                     str(attempt_dir / f"filtered_{name}.log"))
    return out


def open_rank_logs(
    spec: WorkerSpec, attempt_dir: Path, local_rank: int, rank: int, pump: LogPump
) -> RankLogs:
    """Create the rank's directory and the fds its worker writes to (files or tee pipes).

    Per stream, as torchrun decides it: redirected or tee'd → ``<stream>.log``; tee'd and in
    ``local_ranks_filter`` (or no filter) → also the console, prefixed; neither redirected nor
    tee'd → the console as is, or ``/dev/null`` for a rank outside the filter.
    """
    rank_dir = attempt_dir / str(local_rank)
    make_private_dir(rank_dir)
    logs = RankLogs(local_rank, rank_dir, None, None, str(rank_dir / "error.json"))
    redirect, tee = std_for(spec.redirects, local_rank), std_for(spec.tee, local_rank)
    shown = not spec.local_ranks_filter or local_rank in spec.local_ranks_filter
    prefix = line_prefix(spec, local_rank, rank)
    for stream, name in ((Std.OUT, "stdout"), (Std.ERR, "stderr")):
        fd: Optional[int] = None
        if (redirect | tee) & stream:
            path = str(rank_dir / f"{name}.log")
            setattr(logs, f"{name}_path", path)
            if tee & stream and shown:
                fd = pump.add(stream, path, prefix)
            else:
                fd = os.open(path, FILE_FLAGS, FILE_MODE)
        elif not shown:
            fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        if fd is not None:
            logs._owned.append(fd)
        setattr(logs, f"child_{name}", fd)
    return logs

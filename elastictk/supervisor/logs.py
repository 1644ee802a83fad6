"""The log tree's rules: per-run and per-attempt directories, one rank's files, their modes.

Layout (torchrun's): ``<log_dir>/<run_id>/attempt_<n>/<local_rank>/{stdout,stderr}.log`` and the
rank's ``error.json`` beside them. Unlike torchrun, nothing is ever deleted or overwritten:

- an attempt directory is created with ``mkdir`` (no ``exist_ok``); starting an attempt number a
  second time is refused, so a re-rendezvous that keeps the restart count cannot wipe the logs
  of the attempt that failed;
- a run directory left by an earlier run with the same run id is never reused: the group claims
  ``<run_id>``, else ``<run_id>.1``, ``<run_id>.2`` ... with an atomic ``mkdir`` (two agents
  sharing a log dir cannot claim the same one) and reports the one it got.

Redirected streams are written by the worker itself (its fd 1/2 is the file); tee'd streams go
through ``logpump``'s pump; a ``--logs-specs`` class's layout is ``logspecs``'s; which ranks'
files are opened when is ``grouplogs``'s.

Logs hold whatever workers print (tokens, paths, data): every log directory is created mode
0700 and every log file 0600 (``DIR_MODE``/``FILE_MODE``, used by every module that creates
one), set at creation (the directory modes exactly, whatever the umask).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Optional

from .._paths import dir_problem
from .spec import WorkerSpec

FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
"""How every log file in elastictk's layout is opened: created, never one that exists."""
DIR_MODE = 0o700
"""Mode of every log directory created here."""
FILE_MODE = 0o600
"""Mode of every log file created here."""


class LogDirError(RuntimeError):
    """A log directory that cannot be used; the message names the path and the fix."""


def make_private_dir(path: Path, exist_ok: bool = False) -> None:
    """``mkdir`` ``path`` mode 0700 (the umask may only have cleared bits; chmod sets them).

    With ``exist_ok`` an existing directory is left as it is (it is not ours to change).
    """
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if exist_ok and path.is_dir():
            return
        raise
    os.chmod(path, DIR_MODE)


def claim_run_dir(log_dir: Path, run_id: str) -> Path:
    """Create and return a run directory for ``run_id`` that no earlier run has used."""
    if not run_id or "/" in run_id or run_id in (".", "..") or "\0" in run_id:
        raise LogDirError(f"run id {run_id!r} cannot name a directory; use letters, digits, '-', '_'")
    try:
        os.makedirs(log_dir, mode=DIR_MODE, exist_ok=True)  # a new one private; an old one as is
    except OSError as e:
        raise LogDirError(f"cannot create log dir {log_dir}: {e.strerror}; pass a writable --log-dir") from None
    # Whoever else can write the log dir can rename the run's directory away or plant links in
    # its place (_paths): it must be this user's, not writable by others.
    problem = dir_problem(log_dir, "log directory")
    if problem is not None:
        raise LogDirError(f"cannot use log dir {log_dir}: {problem}")
    for n in range(10_000):
        candidate = log_dir / (run_id if n == 0 else f"{run_id}.{n}")
        try:
            make_private_dir(candidate)
            return candidate
        except FileExistsError:
            continue
        except OSError as e:
            raise LogDirError(f"cannot create {candidate}: {e.strerror}; pass a writable --log-dir") from None
    raise LogDirError(f"{log_dir} already holds 10000 runs named {run_id!r}; pass a fresh run id")


def make_attempt_dir(run_dir: Path, attempt: int) -> Path:
    """``<run_dir>/attempt_<attempt>``, which must not exist yet."""
    path = run_dir / f"attempt_{attempt}"
    try:
        make_private_dir(path)
    except FileExistsError:
        raise LogDirError(
            f"{path} already exists: attempt {attempt} was started before; number attempts upward"
        ) from None
    return path


def line_prefix(spec: WorkerSpec, local_rank: int, rank: int) -> str:
    """``[default0]:`` (torchrun's tee header) or the spec's template filled in; an empty
    template is no template, as for torchrun (``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=``)."""
    if not spec.log_line_prefix_template:
        return f"[{spec.role}{local_rank}]:"
    return Template(spec.log_line_prefix_template).safe_substitute(
        role_name=spec.role, rank=rank, local_rank=local_rank)


@dataclass
class RankLogs:
    """Where one rank's streams go. ``child_*`` are fds for the worker's 1/2 (None: the console)."""

    local_rank: int
    dir: Path
    stdout_path: Optional[str]
    stderr_path: Optional[str]
    error_file: str
    child_stdout: Optional[int] = None
    child_stderr: Optional[int] = None
    _owned: list[int] = field(default_factory=list)

    def owned_fds(self) -> list[int]:
        return list(self._owned)

    def close_child_ends(self) -> None:
        """Close the agent's copies of the worker's fds once the worker holds its own."""
        for fd in self._owned:
            try:
                os.close(fd)
            except OSError:
                pass
        self._owned.clear()

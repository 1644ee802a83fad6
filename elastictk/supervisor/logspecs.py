"""A torch ``LogsSpecs`` class (``--logs-specs``) decides where each rank's streams go.

Apart from ``logs.py`` (elastictk's own layout) because it is the other layout: torch's
``reify`` is asked once per attempt, its answer (``Reified``) checked into plain data, and each
rank's fds opened where it says (truncated, as torch opens them; appended to for a replacement).
A plugin's bug is one line naming it (``LogDirError``), never a traceback.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .logpump import LineFilter, LogPump
from .logs import FILE_MODE, LogDirError, RankLogs, line_prefix
from .spec import Std, WorkerSpec

_SPECS_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC  # torch opens them "w"


@dataclass(frozen=True)
class Reified:
    """Where one attempt's streams go, as a torch ``LogsSpecs.reify`` decided (``--logs-specs``).

    Per local rank: ``stdouts``/``stderrs`` ("" the console, else a path; ``os.devnull``
    discards), ``tee`` (the streams whose file is also copied to the console), ``error_files``
    (``""`` none); ``filtered`` the files of the duplicate filters; ``env`` what ``reify``
    changed in each rank's environment (torch passes those changes on to the worker, e.g.
    ``TORCHELASTIC_ERROR_FILE``).
    """

    stdouts: dict[int, str]
    stderrs: dict[int, str]
    tee: dict[int, Std]
    error_files: dict[int, str]
    filtered: dict[Std, str]
    env: dict[int, dict[str, str]]

    @property
    def attempt_dir(self) -> Optional[Path]:
        """Where reports beside the logs go (``<dir>/<local_rank>/``): the directory holding the
        ranks' directories when the error files are ``.../<local_rank>/<file>`` (torch's default
        layout), else the one directory holding all the error files; None without error files."""
        files = {lr: Path(f) for lr, f in self.error_files.items() if f}
        if not files:
            return None
        if all(f.parent.name == str(lr) for lr, f in files.items()):
            return Path(os.path.commonpath([f.parent.parent for f in files.values()]))
        return Path(os.path.commonpath([f.parent for f in files.values()]))

    @property
    def run_dir(self) -> Optional[Path]:
        """The attempt directory's parent when it is named ``attempt_<n>`` (torch's default
        layout), else the attempt directory itself."""
        d = self.attempt_dir
        return d.parent if d is not None and d.name.startswith("attempt_") else d


def reify(logs_specs: object, envs: dict[int, dict[str, str]]) -> Reified:
    """Ask ``logs_specs`` (a ``torch.distributed.elastic.multiprocessing.LogsSpecs``) where the
    streams of workers with torch's environments ``envs`` go. ``envs`` is left as it was;
    what ``reify`` changed in it is returned in ``Reified.env``."""
    view = {lr: dict(env) for lr, env in envs.items()}
    name = type(logs_specs).__name__
    try:
        dest = logs_specs.reify(view)  # type: ignore[attr-defined]
        out = Reified(
            stdouts={lr: str(dest.stdouts.get(lr, "")) for lr in envs},
            stderrs={lr: str(dest.stderrs.get(lr, "")) for lr in envs},
            tee={lr: (Std.OUT if lr in dest.tee_stdouts else Std.NONE)
                 | (Std.ERR if lr in dest.tee_stderrs else Std.NONE) for lr in envs},
            error_files={lr: _no_devnull(str(dest.error_files.get(lr, ""))) for lr in envs},
            filtered={Std.OUT: str(dest.filtered_stdout or ""), Std.ERR: str(dest.filtered_stderr or "")},
            env={lr: {k: v for k, v in view[lr].items() if envs[lr].get(k) != v} for lr in envs},
        )
    except Exception as e:  # a plugin's bug: one line naming it, not a traceback
        raise LogDirError(f"--logs-specs {name}.reify failed: {type(e).__name__}: {e}; "
                          "fix the LogsSpecs class or leave --logs-specs out") from None
    return out


def _no_devnull(path: str) -> str:
    return "" if path == os.devnull else path


def reified_filters(spec: WorkerSpec, dest: Reified) -> "dict[Std, LineFilter]":
    """The spec's ``duplicate_*_filters`` appending to the files ``dest`` names (skipped where
    that file cannot be: torch's default layout under ``--log-dir /dev/null``)."""
    out: dict[Std, LineFilter] = {}
    for stream, name in ((Std.OUT, "stdout"), (Std.ERR, "stderr")):
        needles, path = getattr(spec, f"duplicate_{name}_filters"), dest.filtered[stream]
        if needles and path and os.path.isdir(os.path.dirname(path) or "."):
            out[stream] = LineFilter(tuple(n.encode() for n in needles), path)
    return out


def open_reified_rank_logs(spec: WorkerSpec, dest: Reified, local_rank: int, rank: int,
                           pump: LogPump, append: bool = False) -> RankLogs:
    """The fds one rank's worker writes to, where ``dest`` says: a file (truncated, as torch
    opens it; ``append`` for a replacement worker writing where its predecessor did), the file
    and the console (tee'd, prefixed), or the console as is."""
    flags = (_SPECS_FLAGS & ~os.O_TRUNC) | os.O_APPEND if append else _SPECS_FLAGS | os.O_APPEND
    error_file = dest.error_files[local_rank]
    logs = RankLogs(local_rank, Path(error_file).parent if error_file else Path(os.devnull),
                    None, None, error_file)
    prefix = line_prefix(spec, local_rank, rank)
    for stream, name, target in ((Std.OUT, "stdout", dest.stdouts[local_rank]),
                                 (Std.ERR, "stderr", dest.stderrs[local_rank])):
        fd: Optional[int] = None
        if target:
            if target != os.devnull:
                setattr(logs, f"{name}_path", target)
            if dest.tee[local_rank] & stream and target != os.devnull:
                fd = pump.add(stream, target, prefix, flags)
            else:
                fd = os.open(target, flags, FILE_MODE)
            logs._owned.append(fd)
        setattr(logs, f"child_{name}", fd)
    return logs

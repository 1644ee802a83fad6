"""What a worker group runs (``WorkerSpec``) and what each worker left behind (``WorkerResult``).

A spec is plain data: the agent builds one from CLI flags, the group starts it once per attempt.
Keeping it immutable means an attempt can never change what the next attempt runs by accident.
Validation happens here, once, so a bad flag fails with one line before any process starts.
"""
from __future__ import annotations

import enum
import os
import re
import signal as _signal
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

FUNCTION_METHODS = ("spawn", "fork", "forkserver", "preload")
ARGV_METHODS = ("subprocess", "preload")
LOCAL_RANK_MACRO = "${local_rank}"


class SpecError(ValueError):
    """A worker spec that cannot run; the message names the field and the fix."""


class Std(enum.IntFlag):
    """Which of a worker's streams go to a file: torchrun's ``--redirects``/``--tee`` values."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3

    @classmethod
    def parse(cls, text: str) -> "Std | dict[int, Std]":
        """``"3"`` → ``Std.ALL``; ``"0:3,1:0"`` → ``{0: Std.ALL, 1: Std.NONE}`` (torchrun syntax)."""
        text = text.strip()
        if re.fullmatch(r"[0-3]", text):
            return cls(int(text))
        if re.fullmatch(r"(\d+:[0-3],)*\d+:[0-3]", text):
            out: dict[int, Std] = {}
            for item in text.split(","):
                rank, value = item.split(":")
                out[int(rank)] = cls(int(value))
            return out
        raise SpecError(
            f"redirect/tee value {text!r} is not 0-3 or a list like '0:3,1:0' "
            "(0 none, 1 stdout, 2 stderr, 3 both)"
        )


StdSetting = Std | Mapping[int, Std]


def std_for(setting: StdSetting, local_rank: int) -> Std:
    """The setting of one local rank; ranks missing from a mapping get ``Std.NONE`` (as torch)."""
    if isinstance(setting, Mapping):
        return Std(setting.get(local_rank, Std.NONE))
    return Std(setting)


@dataclass(frozen=True)
class PythonTarget:
    """A Python script or module recognised in an argv, so a preloaded server can ``runpy`` it."""

    kind: str  # "script" | "module"
    target: str  # file path or dotted module name
    args: tuple[str, ...]


_PY_EXE = re.compile(r"python[0-9.]*$")


def parse_python_argv(argv: Sequence[str]) -> Optional[PythonTarget]:
    """``[python, -u, script, *args]`` or ``[python, -u, -m, mod, *args]``; None for anything else.

    Only ``-u`` is accepted as an interpreter option: a preloaded worker inherits the server's
    interpreter, so options that change the interpreter (``-O``, ``-X``) cannot be honoured.
    """
    if not argv:
        return None
    exe = argv[0]
    if exe != sys.executable and not _PY_EXE.match(os.path.basename(exe)):
        return None
    rest = list(argv[1:])
    while rest and rest[0] == "-u":
        rest.pop(0)
    if len(rest) >= 2 and rest[0] == "-m":
        return PythonTarget("module", rest[1], tuple(rest[2:]))
    if rest and not rest[0].startswith("-"):
        return PythonTarget("script", rest[0], tuple(rest[1:]))
    return None


def python_script_argv(script: str, *args: str) -> list[str]:
    """The argv torchrun builds for a script: ``[sys.executable, "-u", script, *args]``."""
    return [sys.executable, "-u", script, *args]


def python_module_argv(module: str, *args: str) -> list[str]:
    """The argv torchrun builds for ``--module``: ``[sys.executable, "-u", "-m", module, *args]``."""
    return [sys.executable, "-u", "-m", module, *args]


@dataclass(frozen=True)
class WorkerSpec:
    """One role's local workers: what to run, how many, how to start them, where output goes.

    ``entrypoint`` is a callable (run in ``local_world_size`` processes started by
    ``start_method`` spawn/fork/forkserver/preload, return values collected per rank) or an argv
    list (run with ``subprocess``, or ``preload`` for a Python script/module argv). ``args`` are
    passed to the callable or appended to the argv; the string ``${local_rank}`` in string args
    and argv entries is replaced per rank, as torchrun does.

    ``redirects`` sends streams to ``<attempt dir>/<local_rank>/{stdout,stderr}.log`` only;
    ``tee`` sends them to the file and to the agent's console with a ``[role<local_rank>]:``
    prefix (``log_line_prefix_template`` may use ``${role_name}``, ``${rank}``,
    ``${local_rank}``). ``local_ranks_filter`` limits which ranks reach the console at all.
    ``duplicate_stdout_filters``/``duplicate_stderr_filters``: tee'd lines holding any of these
    strings are also appended, prefixed, to ``<attempt dir>/filtered_{stdout,stderr}.log``
    (all ranks in one file, torchrun's ``--duplicate-*-filters``).
    ``logs_specs`` (a torch ``LogsSpecs``, torchrun's ``--logs-specs``) takes over where the
    streams and error files go: its ``reify`` decides per attempt instead of elastictk's layout.
    ``grace_period`` is how long ``stop`` waits after SIGTERM before SIGKILL. ``death_signal``
    is what a worker receives when its agent dies (SIGKILL: a world without its agent cannot
    be restarted, so nothing is gained by letting it linger).
    """

    entrypoint: Callable[..., Any] | Sequence[str]
    args: tuple[Any, ...] = ()
    local_world_size: int = 1
    role: str = "default"
    start_method: Optional[str] = None
    env: Mapping[str, str] = field(default_factory=dict)
    redirects: StdSetting = Std.NONE
    tee: StdSetting = Std.NONE
    local_ranks_filter: Optional[frozenset[int]] = None
    log_line_prefix_template: Optional[str] = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    logs_specs: Optional[object] = field(default=None, compare=False)
    grace_period: float = 30.0
    death_signal: int = int(_signal.SIGKILL)
    virtual_local_rank: bool = False  # torchrun's --virtual-local-rank (supervisor/env.py)

    def __post_init__(self) -> None:
        if isinstance(self.entrypoint, (str, bytes)):
            raise SpecError(
                f"entrypoint {self.entrypoint!r} is a string; pass an argv list "
                "(e.g. python_script_argv(path)) or a callable"
            )
        if not callable(self.entrypoint):
            argv = list(self.entrypoint)
            if not argv or not all(isinstance(a, str) for a in argv):
                raise SpecError("entrypoint must be a callable or a non-empty list of strings")
            object.__setattr__(self, "entrypoint", tuple(argv))
        object.__setattr__(self, "args", tuple(self.args))
        if not isinstance(self.local_world_size, int) or self.local_world_size < 1:
            raise SpecError(f"local_world_size must be an integer >= 1, got {self.local_world_size!r}")
        if not self.role or not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.role):
            raise SpecError(f"role {self.role!r} must be non-empty letters, digits, '_', '.' or '-'")
        method = self.start_method or ("spawn" if self.is_function else "subprocess")
        object.__setattr__(self, "start_method", method)
        allowed = FUNCTION_METHODS if self.is_function else ARGV_METHODS
        if method not in allowed:
            kind = "a callable" if self.is_function else "an argv"
            raise SpecError(f"start_method {method!r} cannot run {kind}; use one of {', '.join(allowed)}")
        if not self.is_function and method == "preload" and parse_python_argv(self.argv(0)) is None:
            raise SpecError(
                f"start_method 'preload' runs Python scripts/modules, not {self.argv(0)[:3]!r}; "
                "use start_method='subprocess' for a binary"
            )
        if self.grace_period < 0:
            raise SpecError(f"grace_period must be >= 0 seconds, got {self.grace_period!r}")
        for name in ("redirects", "tee"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = Std.parse(value)
            elif isinstance(value, Mapping):
                value = {int(k): Std(v) for k, v in value.items()}
            else:
                value = Std(value)
            object.__setattr__(self, name, value)
        if self.local_ranks_filter is not None:
            object.__setattr__(self, "local_ranks_filter", frozenset(self.local_ranks_filter))
        for name in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise SpecError(f"{name} must be a sequence of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        try:
            _signal.Signals(self.death_signal)
        except ValueError:
            raise SpecError(f"death_signal {self.death_signal!r} is not a signal number") from None
        bad = [k for k, v in self.env.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise SpecError(f"env values must be strings; fix {bad[0]!r}")

    @property
    def is_function(self) -> bool:
        return callable(self.entrypoint)

    def rank_args(self, local_rank: int) -> tuple[Any, ...]:
        """``args`` with ``${local_rank}`` replaced in string arguments."""
        return tuple(
            a.replace(LOCAL_RANK_MACRO, str(local_rank)) if isinstance(a, str) else a
            for a in self.args
        )

    def argv(self, local_rank: int) -> list[str]:
        """The full command line of one argv worker."""
        if self.is_function:
            raise SpecError("a callable entrypoint has no argv")
        full = [*self.entrypoint, *(str(a) for a in self.args)]  # type: ignore[misc]
        return [a.replace(LOCAL_RANK_MACRO, str(local_rank)) for a in full]


def signal_name(returncode: Optional[int]) -> Optional[str]:
    """``-11`` → ``"SIGSEGV"``; None for a normal exit (>= 0) or a process still running."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return _signal.Signals(-returncode).name
    except ValueError:
        return f"SIG{-returncode}"


@dataclass(frozen=True)
class WorkerResult:
    """How one worker of one attempt ended: everything a failure report needs, nothing live.

    ``exitcode`` is Popen-style (negative when a signal ended the process, as torch reports it);
    ``signal``/``signal_name`` say the same in words. Times are monotonic; ``ended_at`` is when
    the group observed the exit (pidfd readiness, so within scheduling delay of the real exit).
    ``stopped`` is True when the exit was observed while ``stop()`` was stopping the attempt, so
    a report can tell a crash from a shutdown.
    """

    local_rank: int
    rank: int
    role_rank: int
    role: str
    attempt: int
    pid: int
    exitcode: int
    started_at: float
    ended_at: float
    stdout_path: Optional[str] = None
    stderr_path: Optional[str] = None
    error_file: Optional[str] = None
    return_value: Any = None
    stopped: bool = False

    @property
    def signal(self) -> Optional[int]:
        return -self.exitcode if self.exitcode < 0 else None

    @property
    def signal_name(self) -> Optional[str]:
        return signal_name(self.exitcode)

    @property
    def failed(self) -> bool:
        return self.exitcode != 0

    def describe(self) -> str:
        """``rank 3 (local 1, pid 123): SIGSEGV`` / ``... exit code 3``."""
        how = self.signal_name or f"exit code {self.exitcode}"
        return f"rank {self.rank} (local {self.local_rank}, pid {self.pid}): {how}"

"""Per-attempt, per-rank log files, and the tee that copies them to the console with a prefix.

Layout (torchrun's): ``<log_dir>/<run_id>/attempt_<n>/<local_rank>/{stdout,stderr}.log`` and the
rank's ``error.json`` beside them. Unlike torchrun, nothing is ever deleted or overwritten:

- an attempt directory is created with ``mkdir`` (no ``exist_ok``); starting an attempt number a
  second time is refused, so a re-rendezvous that keeps the restart count cannot wipe the logs
  of the attempt that failed;
- a run directory left by an earlier run with the same run id is never reused: the group claims
  ``<run_id>``, else ``<run_id>.1``, ``<run_id>.2`` ... with an atomic ``mkdir`` (two agents
  sharing a log dir cannot claim the same one) and reports the one it got.

Redirected streams are written by the worker itself (its fd 1/2 is the file). Tee'd streams go
through a pipe to one pump thread per attempt that appends each chunk to the file and each line,
prefixed ``[role<local_rank>]:`` (or ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` filled in), to the
console, as it arrives (no file tailing). The console is what torchrun's tail threads write to:
the caller's ``sys.stdout``/``sys.stderr`` as they are when the attempt starts, so a library
caller of ``main()`` can capture the lines (``contextlib.redirect_stdout``, pytest's ``capsys``);
while they are the process's own streams the pump writes to their fds directly (bytes as the
worker wrote them, no decoding).
With ``duplicate_*_filters`` the pump also appends the tee'd lines that hold a filter string,
prefixed the same way, to ``attempt_<n>/filtered_{stdout,stderr}.log`` (one file for all ranks,
replacements included: torchrun's layout).

Logs hold whatever workers print (tokens, paths, data): every directory this module creates is
mode 0700 and every file 0600, set at creation (the directory modes exactly, whatever the umask).
"""
from __future__ import annotations

import contextlib
import os
import selectors
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Iterator, Optional, TextIO, TypeAlias

from .._paths import dir_problem
from .spec import Std, WorkerSpec, std_for

_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
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


def line_filters(spec: WorkerSpec, attempt_dir: Path) -> "dict[Std, LineFilter]":
    """The spec's ``duplicate_*_filters`` as the files an attempt's pumps append matches to."""
    out: dict[Std, LineFilter] = {}
    for stream, name in ((Std.OUT, "stdout"), (Std.ERR, "stderr")):
        needles = getattr(spec, f"duplicate_{name}_filters")
        if needles:
            out[stream] = LineFilter(tuple(n.encode() for n in needles),
                                     str(attempt_dir / f"filtered_{name}.log"))
    return out


@dataclass(frozen=True)
class LineFilter:
    """Lines holding any of ``needles`` also go to ``path``."""

    needles: tuple[bytes, ...]
    path: str

    def pick(self, lines: list[bytes]) -> list[bytes]:
        return [ln for ln in lines if any(n in ln for n in self.needles)]


Console: TypeAlias = "int | TextIO | None"
"""Where tee'd lines go: an fd, a text stream, or None: the caller's ``sys.stdout``/``sys.stderr``
as they are when the pump is made (torchrun's ``TailLog`` takes ``sys.stdout`` at start)."""


class ConsoleSink:
    """One console stream of a pump: whole lines written as bytes to an fd, or decoded (UTF-8,
    undecodable bytes replaced, as torchrun's tail reads them) to a text stream and flushed.
    Errors are swallowed: a closed console must not stall the workers."""

    def __init__(self, target: Console, std: Std) -> None:
        if target is None:
            stream: Optional[TextIO] = sys.stdout if std == Std.OUT else sys.stderr
            target = stream
            if stream is not None and _is_process_stream(stream, std):
                try:
                    stream.flush()
                    target = stream.fileno()  # the process's own stream: its fd, bytes as is
                except (OSError, ValueError, AttributeError):
                    pass
        self.fd = target if isinstance(target, int) else -1
        self.stream: Optional[TextIO] = None if isinstance(target, int) else target

    def write(self, data: bytes) -> None:
        if self.fd >= 0:
            _write_all(self.fd, data, quiet=True)
        elif self.stream is not None:
            try:
                self.stream.write(data.decode("utf-8", errors="replace"))
                self.stream.flush()
            except (OSError, ValueError):
                pass


def _is_process_stream(stream: TextIO, std: Std) -> bool:
    """``stream`` is the interpreter's own stdout/stderr (nobody replaced it)."""
    return stream is (sys.__stdout__ if std == Std.OUT else sys.__stderr__)


class LogPump:
    """One thread that copies tee pipes to their files and, prefixed by line, to the console
    (and to the filtered files of ``filters``, by stream)."""

    def __init__(self, console_out: Console = None, console_err: Console = None,
                 filters: "Optional[dict[Std, LineFilter]]" = None) -> None:
        self._console = {Std.OUT: ConsoleSink(console_out, Std.OUT),
                         Std.ERR: ConsoleSink(console_err, Std.ERR)}
        # Appended to, not created exclusively: an in-place replacement's pump shares the file.
        self._filtered = {stream: (f, os.open(f.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND
                                              | os.O_CLOEXEC, FILE_MODE))
                          for stream, f in (filters or {}).items()}
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread: Optional[threading.Thread] = None
        self._quit = False

    def add(self, stream: Std, path: str, prefix: Optional[str], flags: int = _FILE_FLAGS) -> int:
        """A pipe whose data goes to ``path`` (opened with ``flags``) and (when ``prefix`` is
        set) the console; returns the write end for the worker. Register before ``start``."""
        file_fd = os.open(path, flags, FILE_MODE)
        r, w = os.pipe2(os.O_CLOEXEC)
        f = self._filtered.get(stream) if prefix is not None else None
        self._sel.register(r, selectors.EVENT_READ, _Source(file_fd, self._console[stream], prefix,
                                                            *(f or (None, -1))))
        return w

    def fds(self) -> list[int]:
        return ([k.fd for k in self._sel.get_map().values()] + [self._wake_w]
                + [fd for _, fd in self._filtered.values()])

    @property
    def active(self) -> bool:
        return len(self._sel.get_map()) > 1

    def start(self) -> None:
        if self.active and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elastictk-log-pump", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while len(self._sel.get_map()) > 1 and not self._quit:
            for key, _ in self._sel.select():
                if key.data is None:
                    self._quit = True
                    break
                self._pump(key.fd, key.data)
        if self._quit:  # copy what is already buffered, without waiting for writers
            for key in list(self._sel.get_map().values()):
                if key.data is not None:
                    os.set_blocking(key.fd, False)
                    try:
                        while self._pump(key.fd, key.data):
                            pass
                    except BlockingIOError:
                        self._finish(key.fd, key.data)

    def _pump(self, fd: int, src: "_Source") -> bool:
        data = os.read(fd, 65536)
        if not data:
            self._finish(fd, src)
            return False
        _write_all(src.file_fd, data, quiet=True)  # a full disk must not stall the workers
        if src.prefix is not None:
            src.partial += data
            lines = src.partial.split(b"\n")
            src.partial = lines.pop()
            if lines:
                self._lines(src, lines)
        return True

    def _lines(self, src: "_Source", lines: list[bytes]) -> None:
        assert src.prefix is not None
        head = src.prefix.encode()
        src.console.write(b"".join(head + ln + b"\n" for ln in lines))
        if src.filter is not None:
            picked = src.filter.pick(lines)
            if picked:
                _write_all(src.filtered_fd, b"".join(head + ln + b"\n" for ln in picked), quiet=True)

    def _finish(self, fd: int, src: "_Source") -> None:
        if src.prefix is not None and src.partial:
            self._lines(src, [src.partial])
        self._sel.unregister(fd)
        os.close(fd)
        os.close(src.file_fd)

    def close(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for every writer to close its end (EOF), then stop.
        False if some writer (an escaped process) still held a pipe; its buffered data is kept."""
        clean = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                clean = False
                os.write(self._wake_w, b"x")
                self._thread.join()
            self._thread = None
        for key in list(self._sel.get_map().values()):
            if key.data is not None:
                self._finish(key.fd, key.data)
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        for _, fd in self._filtered.values():
            os.close(fd)
        self._filtered = {}
        return clean


@dataclass
class _Source:
    file_fd: int
    console: ConsoleSink
    prefix: Optional[str]
    filter: Optional[LineFilter] = None
    filtered_fd: int = -1
    partial: bytes = b""


def _write_all(fd: int, data: bytes, quiet: bool = False) -> None:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        if not quiet:
            raise


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
                fd = os.open(path, _FILE_FLAGS, FILE_MODE)
        elif not shown:
            fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        if fd is not None:
            logs._owned.append(fd)
        setattr(logs, f"child_{name}", fd)
    return logs


# -- a torch LogsSpecs (--logs-specs) decides the layout ------------------------------------------

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


@contextlib.contextmanager
def closed_on_error(pump: LogPump) -> Iterator[None]:
    """Close ``pump`` (its pipes and files) if opening the ranks' logs into it fails."""
    try:
        yield
    except BaseException:
        pump.close(0)
        raise

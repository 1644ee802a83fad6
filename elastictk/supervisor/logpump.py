"""The tee: one thread copying workers' pipes to their files and, prefixed by line, to the console.

Apart from ``logs.py`` (where the files are) because it is the one moving part of logging: a
thread, a ``select`` over every tee pipe, and the rules for what a line on the console is.

Tee'd streams go through a pipe to one pump thread per attempt that appends each chunk to the
file and each line, prefixed ``[role<local_rank>]:`` (or ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``
filled in), to the console, as it arrives (no file tailing). The console is what torchrun's tail
threads write to: the caller's ``sys.stdout``/``sys.stderr`` as they are when the attempt starts,
so a library caller of ``main()`` can capture the lines (``contextlib.redirect_stdout``, pytest's
``capsys``); while they are the process's own streams the pump writes to their fds directly
(bytes as the worker wrote them, no decoding).
With ``duplicate_*_filters`` the pump also appends the tee'd lines that hold a filter string,
prefixed the same way, to ``attempt_<n>/filtered_{stdout,stderr}.log`` (one file for all ranks,
replacements included: torchrun's layout).
"""
from __future__ import annotations

import contextlib
import os
import selectors
import sys
import threading
from dataclasses import dataclass
from typing import Iterator, Optional, TextIO, TypeAlias

from .logs import FILE_FLAGS, FILE_MODE
from .spec import Std


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

    def add(self, stream: Std, path: str, prefix: Optional[str], flags: int = FILE_FLAGS) -> int:
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


@contextlib.contextmanager
def closed_on_error(pump: LogPump) -> Iterator[None]:
    """Close ``pump`` (its pipes and files) if opening the ranks' logs into it fails."""
    try:
        yield
    except BaseException:
        pump.close(0)
        raise

"""Worker error files: the ``@record`` decorator that writes them and the reader that parses them.

A worker's exception happens in another process than the supervisor, so the traceback travels
through a file named by ``TORCHELASTIC_ERROR_FILE``. The format is torch's, byte-for-byte in
shape, so that a worker decorated with torch's ``@record`` works under elastictk and a worker
decorated with ``elastictk.record`` works under torchrun::

    {"message": {"message": "<Type>: <msg>",
                 "extraInfo": {"py_callstack": "<traceback>", "timestamp": "<int secs>"},
                 "errorCode": <int, only when copied upward by a parent>}}

Torch also reads a flat form, ``{"message": "<text>", "timestamp": <int>}``; so do we.

Differences from torch, each on purpose: the file is written atomically (a reader never sees half
a file), a failure to write it never hides the worker's own exception, and the reader turns any
bad file into one line that names the path instead of raising a JSON traceback.
"""
from __future__ import annotations

import faulthandler
import functools
import json
import os
import stat
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, ParamSpec, TypeVar

from .._safejson import Unreadable, loads

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"

# A traceback of a deep recursion is ~100 KiB; anything far past this is not an error file.
MAX_ERROR_FILE_BYTES = 16 * 1024 * 1024

_R = TypeVar("_R")
_P = ParamSpec("_P")


@dataclass(frozen=True)
class ErrorRecord:
    """One parsed error file. ``raw`` keeps the JSON as read so a parent can copy it upward."""

    message: str
    traceback: Optional[str] = None
    timestamp: Optional[int] = None
    error_code: Optional[int] = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        """Plain data for reports (``raw`` is left out: it repeats the other fields)."""
        return {
            "message": self.message,
            "traceback": self.traceback,
            "timestamp": self.timestamp,
            "error_code": self.error_code,
        }


class ErrorFileUnreadable(ValueError):
    """An error file exists but is not one: empty, truncated, not JSON, or the wrong shape."""

    def __init__(self, path: str, why: str) -> None:
        self.path = path
        self.why = why
        super().__init__(f"error file {path} is unreadable: {why}")


def exception_payload(exc: BaseException, *, timestamp: int) -> dict[str, Any]:
    """The error-file JSON for ``exc``, exactly as torch's ``ErrorHandler.record_exception``.

    ``timestamp`` is wall-clock seconds (the one place wall time belongs: it is shown to people
    and compared by torch's agent across hosts).
    """
    callstack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": callstack, "timestamp": str(int(timestamp))},
        }
    }


def write_error_file(path: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` atomically (temp file + rename in the same directory).

    Atomic because the supervisor may read the file the moment the worker exits, and a worker
    killed mid-write must leave either the old file or none, never a truncated one.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".error-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fp:
            json.dump(payload, fp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _int_or_none(value: Any) -> Optional[int]:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value == value and abs(value) != float("inf"):
        return int(value)
    if isinstance(value, str):
        try:
            return int(float(value.strip()[:40]))
        except (ValueError, OverflowError):  # "1e999", "nan": not a time
            return None
    return None


def parse_error_payload(data: Any, path: str = "<error file>") -> ErrorRecord:
    """Turn decoded error-file JSON into an ``ErrorRecord``; raise ``ErrorFileUnreadable``.

    Pure: the reader and the tests share it. Accepts both of torch's shapes (nested and flat).
    """
    if not isinstance(data, dict):
        raise ErrorFileUnreadable(path, f"top level is {type(data).__name__}, not a JSON object")
    if "message" not in data:
        raise ErrorFileUnreadable(path, "no 'message' field (not a torch/elastictk error file)")
    message = data["message"]
    if isinstance(message, str):  # torch's flat form
        return ErrorRecord(message=message, timestamp=_int_or_none(data.get("timestamp")),
                           error_code=_int_or_none(data.get("errorCode")), raw=data)
    if not isinstance(message, dict):
        raise ErrorFileUnreadable(path, f"'message' is {type(message).__name__}, not an object")
    text = message.get("message")
    extra = message.get("extraInfo")
    extra = extra if isinstance(extra, dict) else {}
    stack = extra.get("py_callstack")
    stack = stack if isinstance(stack, str) and stack.strip() else None
    if not isinstance(text, str):
        if stack is None:
            raise ErrorFileUnreadable(path, "'message' has neither a message nor a py_callstack")
        text = stack.rstrip().splitlines()[-1]  # the traceback's last line names the exception
    return ErrorRecord(message=text, traceback=stack, timestamp=_int_or_none(extra.get("timestamp")),
                       error_code=_int_or_none(message.get("errorCode")), raw=data)


def read_error_file(path: str) -> Optional[ErrorRecord]:
    """Read a worker's error file: ``None`` if it does not exist (the worker wrote none).

    Any other problem (empty, truncated, garbage, unreadable, too large) raises
    ``ErrorFileUnreadable`` naming the path, so a report can fall back to the stderr log.
    """
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise ErrorFileUnreadable(path, "it is a directory")
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the reader forever
            raise ErrorFileUnreadable(path, "not a regular file")
        with open(path, "rb") as fp:
            blob = fp.read(MAX_ERROR_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ErrorFileUnreadable(path, f"{type(e).__name__}: {e.strerror or e}") from None
    if len(blob) > MAX_ERROR_FILE_BYTES:
        raise ErrorFileUnreadable(path, f"larger than {MAX_ERROR_FILE_BYTES} bytes")
    if not blob.strip():
        raise ErrorFileUnreadable(path, "the file is empty (the worker died while writing it?)")
    try:  # a worker's file, but any process of the user may have written it: parsed safely
        data = loads(blob.decode("utf-8", errors="replace"), max_bytes=None)
    except Unreadable as e:
        raise ErrorFileUnreadable(path, f"{e} (truncated?)") from None
    return parse_error_payload(data, path)


def _enable_faulthandler() -> None:
    """Dump every thread's Python stack to stderr on SIGSEGV/SIGFPE/SIGABRT/SIGBUS/SIGILL.

    Same target as torch: stderr, which the supervisor captures into the worker's log, where the
    failure report finds it. An already-enabled handler (``-X faulthandler``) is left alone.
    """
    if faulthandler.is_enabled():
        return
    try:
        faulthandler.enable(all_threads=True)
    except (ValueError, OSError, AttributeError, RuntimeError):
        try:  # sys.stderr was replaced by something without a file descriptor
            faulthandler.enable(file=sys.__stderr__ or 2, all_threads=True)
        except (ValueError, OSError, AttributeError, RuntimeError):
            pass


def _warn(line: str) -> None:
    try:
        print(f"elastictk.record: {line}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _payload_for(exc: BaseException) -> dict[str, Any]:
    """A parent process (a nested launcher) re-raises its child's failure as an exception that
    knows the root cause's payload; anything else is recorded as itself."""
    upward = getattr(exc, "error_file_payload", None)
    if callable(upward):
        try:
            payload = upward()
            if isinstance(payload, dict):
                return payload
        except Exception:  # a broken payload must not hide the failure; record it plainly
            pass
    return exception_payload(exc, timestamp=int(time.time()))


def record_exception(exc: BaseException, path: Optional[str] = None) -> bool:
    """Write ``exc`` to the error file (``path`` or ``$TORCHELASTIC_ERROR_FILE``).

    Returns whether a file was written. Never raises: the worker's own exception matters more
    than the report about it, so a failed write is one line on stderr.
    """
    path = path if path is not None else os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    try:
        write_error_file(path, _payload_for(exc))
        return True
    except Exception as e:  # noqa: BLE001 - see docstring
        _warn(f"could not write error file {path}: {type(e).__name__}: {e}")
        return False


def record(fn: Callable[_P, _R]) -> Callable[_P, Optional[_R]]:
    """Decorate a worker's main function so an uncaught exception reaches the supervisor.

    On an ``Exception`` the decorator writes the error file named by ``TORCHELASTIC_ERROR_FILE``
    (if set) and re-raises, so the process still exits non-zero with the traceback on stderr.
    ``SystemExit(0)`` returns ``None`` (as torch's, for ``runpy`` entry points); other exits and
    ``KeyboardInterrupt`` pass through unrecorded. Use it once, on the top-level function::

        @elastictk.record
        def main() -> None: ...

        if __name__ == "__main__":
            main()

    Decorating twice (the supervisor wraps function workers itself) wraps once.
    """
    if getattr(fn, "__elastictk_record__", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> Optional[_R]:
        _enable_faulthandler()
        try:
            return fn(*args, **kwargs)
        except SystemExit as se:
            if se.code == 0:
                return None
            raise
        except Exception as e:
            record_exception(e)
            raise

    wrapper.__elastictk_record__ = True  # type: ignore[attr-defined]
    return wrapper

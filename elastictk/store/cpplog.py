"""torch's C++ log level: quiet in the launcher, torch's own in everything that becomes a worker.

c10d logs every client timeout of a blocking store call at warning level from C++ (``[c10d]
waitForInput ... timed out``): a launcher that watches its store with one-second waits printed
two such lines a second for the whole job. elastictk reports store trouble itself, so the
launcher's torch is loaded at ``ERROR``. torch reads ``TORCH_CPP_LOG_LEVEL`` once, when it
loads, so the variable is set for that import only and taken back out of the environment: the
workers inherit this process's environment, which stays torchrun's.

A process forked from the launcher after that import (the preload server, and every worker
forked from it) inherits the quiet level with the memory, not with the environment; it calls
:func:`as_fresh_import` first, which sets the level a fresh interpreter would read from its own
environment (torch's default, ``WARNING``, unless the user set the variable), so a user's
script sees torch's C++ warnings under elastictk-run as under torchrun.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Mapping, Optional

VAR = "TORCH_CPP_LOG_LEVEL"
# torch's own parse (c10/util/Logging.cpp, setLogLevelFlagFromEnv); anything else keeps WARNING
LEVELS = {"0": 0, "INFO": 0, "1": 1, "WARNING": 1, "2": 2, "ERROR": 2, "3": 3, "FATAL": 3}
DEFAULT = 1  # c10's FLAGS_caffe2_log_level when the variable is unset: WARNING
log = logging.getLogger(__name__)


def import_torch_quietly() -> None:
    """Import ``torch.distributed`` with the C++ log level at ``ERROR``, unless torch is loaded
    already or the user chose a level (then theirs holds), leaving the environment as it was."""
    quiet = VAR not in os.environ and "torch" not in sys.modules
    if quiet:
        os.environ[VAR] = "ERROR"
    try:
        import torch.distributed  # noqa: F401
    finally:
        if quiet:
            os.environ.pop(VAR, None)


def fresh_level(env: Mapping[str, str]) -> int:
    """The C++ log level a fresh torch import reads from ``env``."""
    return LEVELS.get(env.get(VAR, "").upper(), DEFAULT)  # upper-cased, not stripped, as c10 does


def _flag() -> Optional[ctypes.c_int32]:
    torch = sys.modules.get("torch")
    path = getattr(torch, "__file__", None)
    if not path:
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(path), "lib", "libc10.so"))
        return ctypes.c_int32.in_dll(lib, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None


def current_level() -> Optional[int]:
    """This process's C++ log level (None: torch not loaded, or its flag not found)."""
    flag = _flag()
    return None if flag is None else int(flag.value)


def as_fresh_import(env: Optional[Mapping[str, str]] = None) -> None:
    """Set the C++ log level to what a fresh interpreter with ``env`` (default: this process's
    environment) would have read; nothing to do while torch is not loaded here."""
    if "torch" not in sys.modules:
        return
    flag = _flag()
    if flag is None:  # a torch build without c10's flag: its level stays the launcher's
        log.debug("torch's C++ log level cannot be set here (no FLAGS_caffe2_log_level in libc10)")
        return
    flag.value = fresh_level(os.environ if env is None else env)

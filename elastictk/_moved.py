"""Old import paths of modules that moved, kept working for one release with a warning.

A shim module calls :func:`redirect` and becomes the new module in ``sys.modules``, so classes
keep one identity whichever path imported them (``isinstance`` and ``except`` still match).
The import goes through ``importlib``: a shim is a pointer, not a dependency of its package, and
the layer contract (``pyproject.toml``) does not count it.
"""
from __future__ import annotations

import importlib
import sys
import warnings
from types import FrameType, ModuleType

REMOVED_IN = "0.3"


def _importer_level() -> int:
    """The stack level of the code that used the old path: the first frame outside this
    module, the shim and Python's import machinery (so the warning names the user's line)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:  # warnings skips these, uncounted
            frame = frame.f_back
            continue
        if frame.f_globals.get("__name__", "").split(".")[0] not in ("elastictk", "importlib"):
            return level
        frame, level = frame.f_back, level + 1
    return 2


def warn_moved(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old path stops working in elastictk {REMOVED_IN}",
                  DeprecationWarning, stacklevel=_importer_level())


def redirect(old: str, new: str) -> ModuleType:
    """Make module ``old`` an alias of ``new`` (call it from ``old``'s body)."""
    warn_moved(old, new)
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module


def moved_call(old: str, new: str, *args: object) -> object:
    """Call ``new`` (``"module:function"``) for a deprecated method ``old`` that forwards to it."""
    module, _, function = new.partition(":")
    warn_moved(old, f"{module}.{function}()")
    return getattr(importlib.import_module(module), function)(*args)


def moved_attribute(package: str, name: str, table: dict[str, str]) -> object:
    """``__getattr__`` of a package whose names in ``table`` (name → new module) moved."""
    new = table.get(name)
    if new is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warn_moved(f"{package}.{name}", f"{new}.{name}")
    value = getattr(importlib.import_module(new), name)
    setattr(sys.modules[package], name, value)  # one warning per name, as for a module
    return value

"""Package faces that load their public names on first use.

A worker imports ``elastictk.supervisor`` on its way to the child set-up and ``elastictk.metrics``
for ``step()``; ``elastictk-run`` imports ``elastictk.agent`` before torch so the fork server's
import of torch overlaps its own. None of them should pay for the heavy modules behind the
names they do not use, so each package's ``__getattr__`` is :func:`exports` over a table of
name → submodule.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping


def exports(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``table`` maps a name to the (relative)
    submodule defining it."""
    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)  # found directly from now on
        return value

    return __getattr__

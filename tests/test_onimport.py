"""``now_or_on_import``: the worker-side hooks' one way to act on a module now or once it loads,
without importing it; a cancelled hook never runs. Real imports of throw-away modules."""
from __future__ import annotations

import importlib
import sys
import threading
from pathlib import Path
from types import ModuleType

from elastictk._onimport import OnImport, now_or_on_import


def _module(tmp_path: Path, name: str) -> None:
    (tmp_path / f"{name}.py").write_text("READY = True\n")
    if str(tmp_path) not in sys.path:
        sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()


def test_applied_on_import_once_and_only_then(tmp_path: Path) -> None:
    _module(tmp_path, "etk_onimport_later")
    seen: list[ModuleType] = []
    lock = threading.Lock()
    try:
        with lock:
            hook = now_or_on_import("etk_onimport_later", "READY", seen.append, lock, None)
            again = now_or_on_import("etk_onimport_later", "READY", seen.append, lock, hook)
        assert isinstance(hook, OnImport) and again is hook, "one hook, not one per call"
        assert seen == [] and "etk_onimport_later" not in sys.modules, "nothing imported by asking"
        import etk_onimport_later  # noqa: F401

        assert [m.__name__ for m in seen] == ["etk_onimport_later"]
        assert hook not in sys.meta_path
        with lock:  # loaded now: applied at once, no hook left pending
            assert now_or_on_import("etk_onimport_later", "READY", seen.append, lock, None) is None
        assert len(seen) == 2
    finally:
        sys.modules.pop("etk_onimport_later", None)
        sys.path.remove(str(tmp_path))


def test_a_cancelled_hook_never_runs(tmp_path: Path) -> None:
    _module(tmp_path, "etk_onimport_cancelled")
    seen: list[ModuleType] = []
    lock = threading.Lock()
    try:
        with lock:
            hook = now_or_on_import("etk_onimport_cancelled", "READY", seen.append, lock, None)
        assert hook is not None
        hook.cancel()
        hook.cancel()  # twice is fine
        import etk_onimport_cancelled  # noqa: F401

        assert seen == [] and hook not in sys.meta_path
    finally:
        sys.modules.pop("etk_onimport_cancelled", None)
        sys.path.remove(str(tmp_path))

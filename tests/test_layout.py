"""The package layout's promises: old import paths keep working for one release (same objects,
with a DeprecationWarning naming the new path), the launcher imports no torch before its fork
server starts, and the death watch runs as a bare script beside procfs.py."""
from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import elastictk

ROOT = Path(__file__).resolve().parent.parent

MOVED_MODULES = {
    "elastictk.supervisor.agent": "elastictk.agent.elastic",
    "elastictk.supervisor.coordination": "elastictk.agent.coordination",
    "elastictk.supervisor.policy": "elastictk.agent.policy",
    "elastictk.supervisor.watchdog": "elastictk.agent.watchdog",
    "elastictk.supervisor.address": "elastictk.agent.address",
    "elastictk.supervisor.inplace": "elastictk.agent.inplace",
    "elastictk.supervisor.inplace_setup": "elastictk.agent.inplace_host",
    "elastictk.supervisor.reaper": "elastictk.lifetime.reaper",
    "elastictk.supervisor.deathwatch": "elastictk.lifetime.deathwatch",
    "elastictk.store.etcd_server": "elastictk.testing.etcd",
    "elastictk.metrics.promserver": "elastictk.testing.prometheus",
}

MOVED_NAMES = [
    ("elastictk.store", "EtcdServer", "elastictk.testing.etcd"),
    ("elastictk.metrics", "PrometheusServer", "elastictk.testing.prometheus"),
    ("elastictk.run", "build_agent", "elastictk.agent.launch"),
    ("elastictk.run", "start_preload", "elastictk.agent.launch"),
    ("elastictk.supervisor.report", "WorkerGroupFailed", "elastictk.supervisor.report_text"),
]


def _fresh_import(name: str) -> tuple[object, list[warnings.WarningMessage]]:
    """Import ``name`` in a subprocess-free way that still runs its body: drop it first."""
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    if parent in sys.modules and hasattr(sys.modules[parent], child):
        delattr(sys.modules[parent], child)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, caught


@pytest.mark.parametrize("old,new", sorted(MOVED_MODULES.items()))
def test_an_old_module_path_is_the_new_module_with_a_warning(old: str, new: str) -> None:
    module, caught = _fresh_import(old)
    assert module is importlib.import_module(new)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any(old in m and new in m for m in messages), messages
    assert all(w.filename == __file__ for w in caught if old in str(w.message)), \
        "the warning must point at the importing line, not at elastictk"


@pytest.mark.parametrize("package,name,new", MOVED_NAMES)
def test_an_old_name_is_the_new_object_with_a_warning(package: str, name: str, new: str) -> None:
    module = importlib.import_module(package)
    vars(module).pop(name, None)  # forget an earlier access in this process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), name)
    assert any(f"{package}.{name}" in str(w.message) for w in caught)


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    import elastictk.store

    with pytest.raises(AttributeError):
        elastictk.store.NoSuchStore  # noqa: B018


def test_the_agent_package_exports_the_launcher_api() -> None:
    from elastictk import agent

    for name in ("ElasticAgent", "AgentConfig", "AgentResult", "RestartPolicy", "Backoff",
                 "build_agent", "start_preload"):
        assert getattr(agent, name) is not None, name


def test_starting_the_preload_server_imports_no_torch_first() -> None:
    """elastictk-run starts the fork server before importing torch (their imports overlap)."""
    code = ("import sys\nfrom elastictk.agent.launch import start_preload\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, check=True).stdout
    assert out.strip() == "False"


def test_the_death_watch_runs_as_a_bare_script() -> None:
    """``python -I -S deathwatch.py``: no elastictk on the path, procfs.py found beside it."""
    script = Path(elastictk.__file__).parent / "lifetime" / "deathwatch.py"
    proc = subprocess.run([sys.executable, "-I", "-S", str(script)], input="bye\n", capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr

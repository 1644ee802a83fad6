"""The package layout's promises: the old import paths are gone in 0.3 (CHANGELOG.md lists them;
tests/test_docs.py checks that table), the launcher imports no torch before its fork server
starts, and the death watch runs as a bare script beside procfs.py."""
from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import elastictk
import elastictk.faults as faults

ROOT = Path(__file__).resolve().parent.parent


def test_no_module_only_redirects_to_another() -> None:
    """A module whose body is an import-and-alias of another is a shim: there are none."""
    shims = [str(p.relative_to(ROOT)) for p in (ROOT / "elastictk").rglob("*.py")
             if "redirect(__name__" in p.read_text() or "warn_moved(" in p.read_text()]
    assert shims == []


def test_fault_point_is_the_one_name_and_quiet() -> None:
    """``elastictk.faults.checkpoint`` (read as ``elastictk.metrics.checkpoint``) is gone."""
    assert "fault_point" in faults.__all__ and "checkpoint" not in faults.__all__
    assert not hasattr(faults, "checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        faults.fault_point(0)  # no plan in this process: a no-op


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

"""The layer and circle contracts that `make check` runs can fail: a copy of the package with an
upward import, or with an import circle inside a package, breaks them (and the clean copy keeps
them). So a green `lint-imports` in CI means the layout holds, not that the check is blind."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    if not LINT.exists():
        pytest.skip("import-linter is not installed (make install puts it in .venv)")
    shutil.copytree(ROOT / "elastictk", tmp_path / "elastictk",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _lint(where: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(where)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=where, env=env, capture_output=True,
                          text=True, timeout=120)


def _append(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(f"\n{line}\n")


def test_the_unchanged_package_keeps_both_contracts(copy: Path) -> None:
    out = _lint(copy)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout


def test_an_upward_import_breaks_the_layer_contract(copy: Path) -> None:
    _append(copy / "elastictk" / "store" / "prefix.py", "from ..agent import policy  # noqa")
    out = _lint(copy)
    assert out.returncode != 0
    assert "layers: nothing imports upward" in out.stdout and "BROKEN" in out.stdout
    assert "elastictk.store.prefix -> elastictk.agent.policy" in out.stdout


def test_an_import_circle_inside_a_package_breaks_the_circle_contract(copy: Path) -> None:
    _append(copy / "elastictk" / "faults" / "env.py", "from . import auto  # noqa")
    out = _lint(copy)
    assert out.returncode != 0
    assert "no import circles" in out.stdout and "BROKEN" in out.stdout

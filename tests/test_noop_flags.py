"""No silent no-ops: a flag accepted for torchrun's sake that can do nothing here says so in one
line at start (the launcher prints each of ``config.warnings`` as ``elastictk-run: warning: ...``)."""
from __future__ import annotations

from pathlib import Path

import pytest

from elastictk.cli import parse_args

SCRIPT = "train.py"


@pytest.fixture(autouse=True)
def _script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / SCRIPT).write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)


def test_monitor_interval_says_it_has_no_effect() -> None:
    (line,) = parse_args(["--monitor-interval", "5", SCRIPT]).warnings
    assert line.startswith("--monitor-interval has no effect") and "\n" not in line
    assert parse_args([SCRIPT]).warnings == ()

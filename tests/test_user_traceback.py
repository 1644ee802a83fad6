"""A worker's uncaught exception reads as ``python script.py`` would print it: the user's frames
only, never the launcher's (``child.py``, runpy) above them, and through the script's own
``sys.excepthook`` when it set one. Real ``elastictk-run`` processes, script and ``-m`` module."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = "def inner():\n    raise ValueError('boom from the script')\n\ninner()\n"


def _run(tmp_path: Path, *target: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "1",
         "--log-dir", str(tmp_path / "logs"), *target],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    return proc.stdout + proc.stderr


def _traceback(out: str) -> list[str]:
    lines = out.splitlines()
    start = lines.index("Traceback (most recent call last):")
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("ValueError"))
    return lines[start:end + 1]


@pytest.mark.parametrize("as_module", [False, True], ids=["script", "module"])
def test_the_traceback_starts_at_the_users_first_frame(tmp_path: Path, as_module: bool) -> None:
    (tmp_path / "usermain.py").write_text(SCRIPT)
    target = ("-m", "usermain") if as_module else ("usermain.py",)
    tb = _traceback(_run(tmp_path, *target))
    frames = [line for line in tb if line.startswith('  File "')]
    assert frames and all("usermain.py" in f for f in frames), "\n".join(tb)
    assert "in <module>" in frames[0] and "in inner" in frames[-1]
    assert tb[-1] == "ValueError: boom from the script"


def test_a_scripts_own_excepthook_reports_it(tmp_path: Path) -> None:
    (tmp_path / "hooked.py").write_text(
        "import sys\n"
        "def hook(kind, value, tb):\n"
        "    print(f'HOOKED {kind.__name__}: {value} at line {tb.tb_lineno}', file=sys.stderr)\n"
        "sys.excepthook = hook\n"
        "raise KeyError('mine')\n")
    out = _run(tmp_path, "hooked.py")
    assert "HOOKED KeyError: 'mine' at line 5" in out
    assert "Traceback (most recent call last)" not in out

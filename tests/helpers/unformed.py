"""An in-place job's ``inplace_unformed.txt`` reports (elastictk/agent/unformed.py), for the tail
of a test's failure output: where each worker was when a generation never formed."""
from __future__ import annotations

from pathlib import Path


def unformed_reports(log_dir: Path) -> str:
    """Every such report under ``log_dir``, each after a newline; empty when there is none."""
    return "".join(f"\n{p.read_text()}" for p in sorted(log_dir.rglob("inplace_unformed.txt")))

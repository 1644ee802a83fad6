"""The launcher's own torch logs quietly; a worker's torch logs as under torchrun.

``elastictk-run`` blocks on its store in one-second waits, and c10d logs every such timeout
from C++ at warning level: two lines a second for a whole job unless the launcher loaded torch
at ``TORCH_CPP_LOG_LEVEL=ERROR``. Workers forked from the preload server (itself forked from
the launcher) must get torch's default level back, and no variable the user did not set.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from elastictk.store import cpplog

ROOT = Path(__file__).resolve().parent.parent
# c10's log line: severity letter, MMDD, time, file:line]
CPP_LINE = re.compile(r"^\[[IWEF]\d{4} |Exception raised from |socket\.cpp")

WORKER = '''
import os, sys, time
import torch
from elastictk.store.cpplog import current_level
# several of the launcher's one-second store waits time out while this runs
time.sleep(4)
print(f"LEVEL {current_level()} VAR {os.environ.get('TORCH_CPP_LOG_LEVEL')}", flush=True)
'''


def test_a_job_of_several_seconds_prints_no_cpp_warning_and_workers_keep_torchs_level(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k != cpplog.VAR}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "2",
                           "--tee", "1", "w.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    noisy = [line for line in proc.stderr.splitlines() if CPP_LINE.search(line)]
    assert noisy == [], f"{len(noisy)} C++ log line(s) from the launcher: {noisy[:4]}"
    levels = re.findall(r"LEVEL (\S+) VAR (\S+)", proc.stdout)
    # torch's default (WARNING = 1) in both workers, and no TORCH_CPP_LOG_LEVEL in their env
    assert levels == [("1", "None"), ("1", "None")], proc.stdout[-2000:]


def test_a_fresh_level_is_read_from_the_environment_as_torch_reads_it() -> None:
    code = ("import os; from elastictk.store import cpplog; from elastictk.store.tcp import TCPStore; "
            "q = cpplog.current_level(); v = os.environ.get('TORCH_CPP_LOG_LEVEL'); "
            "cpplog.as_fresh_import(); a = cpplog.current_level(); "
            "cpplog.as_fresh_import({'TORCH_CPP_LOG_LEVEL': 'info'}); print(q, v, a, cpplog.current_level())")
    env = {k: v for k, v in os.environ.items() if k != cpplog.VAR}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # quiet after elastictk's import, the variable gone again; torch's default back; INFO read as 0
    assert out.stdout.split() == ["2", "None", "1", "0"], out.stdout + out.stderr[-2000:]


@given(st.one_of(st.sampled_from(sorted(cpplog.LEVELS)), st.text(max_size=20)))
def test_fresh_level_matches_torchs_parse(value: str) -> None:
    level = cpplog.fresh_level({cpplog.VAR: value})
    assert level == cpplog.LEVELS.get(value.upper(), 1)
    assert cpplog.fresh_level({cpplog.VAR: f" {value}"}) == 1  # torch does not strip
    assert 0 <= level <= 3
    assert cpplog.fresh_level({}) == 1

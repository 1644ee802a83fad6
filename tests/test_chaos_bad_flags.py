"""Bad values of elastictk-chaos's own flags: one line on stderr naming the flag and the fix, exit
2, before anything runs (no training script started, no report directory made).

One real command line per case (``python -m elastictk.chaos``), so what is checked is what a
user sees; each fails in its first half second, long before a job would start.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROG = "elastictk-chaos"

# (flags, words the one line must hold). {d} is the test's directory, which holds "afile" (a
# regular file), "nested.json" ("[" * 1000) and the training script.
CASES = [
    (["--timeout", "-5"], ["--timeout -5", "more than 0"]),
    (["--timeout", "nan"], ["--timeout nan", "finite number of seconds"]),
    (["--timeout", "inf"], ["--timeout inf", "finite number of seconds"]),
    (["--timeout", "0"], ["--timeout 0", "more than 0"]),
    (["--ckpt-every", "0"], ["--ckpt-every 0", "at least 1"]),
    (["--ckpt-every", "-3"], ["--ckpt-every -3", "at least 1"]),
    (["--kinds", ""], ["--kinds ''", "name at least one kind"]),
    (["--kinds", " , "], ["--kinds ' , '", "name at least one kind"]),
    (["--kinds", "nope"], ["--kinds nope", "unknown fault kind 'nope'"]),
    (["--kinds", "kill-agent"], ["--kinds kill-agent", "--at-seconds LO:HI", "drop it from --kinds"]),
    # the default --hang-detection learned catches hangs (tests/test_chaos_hang_learned.py);
    # with it off, nothing would
    (["--kinds", "hang", "--hang-detection", "off"], ["--kinds hang", "needs --collective-timeout",
                                                      "--hang-detection learned"]),
    (["--faults", "-1"], ["--faults -1", "from 0 to 1000"]),
    (["--faults", "100000000"], ["--faults 100000000", "from 0 to 1000"]),
    (["--faults", "5", "--at-steps", "2:4"], ["--faults 5 with --at-steps 2:4", "lower --faults",
                                              "widen --at-steps"]),
    (["--at-steps", "10:2"], ["--at-steps 10:2", "less than HI", "e.g. --at-steps 2:10"]),
    (["--at-steps=-1:5"], ["--at-steps -1:5", "at least 0"]),
    (["--at-steps", "-1:5"], ["--at-steps", "--flag=VALUE"]),
    (["--faults", "two"], ["--faults", "invalid int value: 'two'", "--help"]),
    (["--at-steps", "ten"], ["--at-steps 'ten'", "write LO:HI"]),
    (["--at-seconds", "5:1"], ["--at-seconds 5:1", "less than HI", "e.g. --at-seconds 3:8"]),
    (["--at-seconds", "nan:5"], ["--at-seconds nan:5", "finite"]),
    (["--at-seconds", "1:inf"], ["--at-seconds 1:inf", "finite"]),
    (["--at-seconds", ""], ["--at-seconds ''", "write LO:HI"]),
    (["--never", "5"], ["--never 5", "ranks 0..0"]),
    (["--nodes", "2", "--nnodes", "2", "--rejoin", "nan"], ["--rejoin nan", "finite"]),
    (["--plan", "{d}/nested.json"], ["{d}/nested.json", "nested too deeply"]),
    (["--plan", "{d}/latin1.json"], ["{d}/latin1.json", "not UTF-8"]),
    (["--plan", "{d}/nan.json"], ["{d}/nan.json", "NaN"]),
    (["--replay", "{d}/nested.json"], ["{d}/nested.json", "the chaos report", "nested too deeply"]),
    (["--report-dir", "{d}/afile/report"], ["--report-dir {d}/afile/report", "under {d}/afile, a file"]),
    (["--report-dir", "{d}/afile"], ["--report-dir {d}/afile", "is a file"]),
]


def _id(flags: list[str]) -> str:
    return " ".join(f.replace("{d}/", "") or "''" for f in flags)[:40]


@pytest.mark.parametrize("flags,names", CASES, ids=[_id(f) for f, _ in CASES])
def test_a_bad_chaos_flag_is_one_line_and_exit_2_before_anything_runs(
        tmp_path: Path, flags: list[str], names: list[str]) -> None:
    (tmp_path / "afile").write_text("a regular file\n")
    (tmp_path / "nested.json").write_bytes(b"[" * 1000)
    (tmp_path / "latin1.json").write_bytes('{"schema": "caf\u00e9"}'.encode("latin-1"))
    (tmp_path / "nan.json").write_bytes(
        b'{"schema": "elastictk.fault-plan/1", "watchdog_s": NaN, "faults": []}')
    script = tmp_path / "train.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    argv = [a.replace("{d}", str(tmp_path)) for a in flags]
    if "--report-dir" not in argv:
        argv = ["--report-dir", str(tmp_path / "report"), *argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTICTK_"))}
    r = subprocess.run([sys.executable, "-m", "elastictk.chaos", *argv, "--nproc-per-node", "1",
                        "--", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"{PROG}: error: "), lines[0]
    for name in names:
        assert name.replace("{d}", str(tmp_path)) in lines[0], (name, lines[0])
    assert not Path(f"{script}.ran").exists(), "the training script ran"
    assert not (tmp_path / "report").exists(), "a report directory was made for a refused run"


def test_good_values_at_the_bounds_pass_the_checks(tmp_path: Path) -> None:
    """The passing side, in process: the checks accept what a run may be given."""
    from elastictk.chaos.cli import parse
    from elastictk.chaos.flags import MAX_FAULTS, check_flags, check_never, report_dir, window

    ns, _, _ = parse(["--timeout", "0.5", "--ckpt-every", "1", "--faults", str(MAX_FAULTS),
                      "--kinds", "sigkill", "--at-steps", "0:1", "--", "train.py"])
    check_flags(ns)
    assert window("--at-seconds", "0:1e9", float) == (0.0, 1e9)
    assert check_never("0,3", 4) == (0, 3)
    made = report_dir(str(tmp_path / "a" / "b"))
    assert made.is_dir()

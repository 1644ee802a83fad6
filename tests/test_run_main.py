"""``elastictk.run.main(argv)`` for a library caller raises where ``torch.distributed.run.main``
raises: ValueError for a bad configuration, ChildFailedError (carrying the failures) when workers
fail, SignalException on SIGTERM; the console entry point keeps its one line and exit codes."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.procs import cmdline

ROOT = Path(__file__).resolve().parent.parent

CALLER = """
import json, sys
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.multiprocessing.api import SignalException
which, argv = sys.argv[1], sys.argv[2:]
if which == "torch":
    from torch.distributed.run import main
else:
    from elastictk.run import main
try:
    value = main(argv)
    out = {"returned": value}
except ChildFailedError as e:
    rank, first = e.get_first_failure()
    out = {"raised": "ChildFailedError", "type": type(e).__name__, "ranks": sorted(e.failures),
           "first_rank": rank, "exitcode": first.exitcode, "error_file": first.error_file,
           "message": str(e)}
except SignalException as e:
    out = {"raised": "SignalException", "sigval": int(e.sigval)}
except ValueError as e:
    out = {"raised": "ValueError", "message": str(e)}
except SystemExit as e:
    out = {"raised": "SystemExit", "code": e.code}
print("RESULT " + json.dumps(out), flush=True)
"""


def call(which: str, argv: list[str], tmp_path: Path, timeout: float = 120) -> dict[str, object]:
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    proc = subprocess.run([sys.executable, str(script), which, *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("argv", [
    ["--no-python", "--module", "--standalone", "x"],
    ["--standalone", "--nproc-per-node", "lots", "x.py"],
])
def test_a_bad_configuration_raises_value_error_like_torch(tmp_path: Path, argv: list[str]) -> None:
    ours, theirs = call("elastictk", argv, tmp_path), call("torch", argv, tmp_path)
    assert theirs["raised"] == "ValueError", theirs
    assert ours["raised"] == "ValueError", ours


def test_an_unknown_flag_exits_2_through_argparse_like_torch(tmp_path: Path) -> None:
    argv = ["--no-such-flag", "x.py"]
    assert call("elastictk", argv, tmp_path) == call("torch", argv, tmp_path) == \
        {"raised": "SystemExit", "code": 2}


def test_failed_workers_raise_child_failed_error_with_the_failures(tmp_path: Path) -> None:
    worker = tmp_path / "w.py"
    worker.write_text("import os, sys\nimport elastictk\n\n@elastictk.record\ndef main():\n"
                      "    if os.environ['RANK'] == '1':\n        raise RuntimeError('rank one broke')\n\n"
                      "main()\n")
    out = call("elastictk", ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                             "--log-dir", str(tmp_path / "logs"), str(worker)], tmp_path)
    assert out["raised"] == "ChildFailedError" and out["type"] == "WorkersFailed", out
    # rank 0 is in the failures too when it was still starting and got stopped (as in torch:
    # the next test)
    assert out["ranks"] in ([1], [0, 1]) and out["first_rank"] == 1 and out["exitcode"] == 1
    assert Path(str(out["error_file"])).is_file()
    assert "rank one broke" in str(out["message"]) and str(worker) in str(out["message"])


def test_ranks_stopped_after_the_failure_are_failures_too_as_in_torch(tmp_path: Path) -> None:
    """Rank 0 is still running when rank 1 fails: the launcher stops it, and like torch's
    ``failures`` ours holds both, rank 1 first."""
    worker = tmp_path / "w.py"
    worker.write_text("import os, time\n\nif os.environ['RANK'] == '1':\n    raise SystemExit(3)\n"
                      "time.sleep(60)\n")
    argv = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", str(worker)]
    ours = call("elastictk", [*argv[:-1], "--log-dir", str(tmp_path / "logs"), argv[-1]], tmp_path)
    theirs = call("torch", [*argv[:-1], "--log-dir", str(tmp_path / "tlogs"), argv[-1]], tmp_path)
    assert theirs["raised"] == "ChildFailedError" and theirs["ranks"] == [0, 1], theirs
    assert ours["raised"] == "ChildFailedError" and ours["ranks"] == [0, 1], ours
    assert ours["first_rank"] == theirs["first_rank"] == 1 and ours["exitcode"] == theirs["exitcode"] == 3


def test_a_finished_job_returns_zero(tmp_path: Path) -> None:
    worker = tmp_path / "ok.py"
    worker.write_text("pass\n")
    out = call("elastictk", ["--standalone", "--nproc-per-node", "1", "--log-dir",
                             str(tmp_path / "logs"), str(worker)], tmp_path)
    assert out == {"returned": 0}


def test_sigterm_raises_signal_exception(tmp_path: Path) -> None:
    worker = tmp_path / "sleep.py"
    worker.write_text("import time; time.sleep(120)\n")
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    proc = subprocess.Popen([sys.executable, str(script), "elastictk", "--standalone", "--nproc-per-node",
                             "1", "--log-dir", str(tmp_path / "logs"), str(worker)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        me = psutil.Process(proc.pid)
        # the worker, not a fork of the caller that has not exec'd yet (its argv names sleep.py too)
        while time.monotonic() < deadline and not any(
                "sleep.py" in cmd and "caller.py" not in cmd
                for cmd in (cmdline(c) for c in me.children(recursive=True))):
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    result = json.loads([line for line in out.splitlines() if line.startswith("RESULT ")][-1][7:])
    assert result == {"raised": "SignalException", "sigval": int(signal.SIGTERM)}, err


def test_the_console_entry_point_keeps_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "elastictk.run", "--no-python", "--module",
                           "--standalone", "x"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr

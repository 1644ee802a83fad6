"""The progress watchdog (``--progress-timeout``, ``--startup-timeout``): a rank that stops
completing steps is caught even where no timer can be (a SIGSTOPped DDP rank, whose peer waits
inside DDP's C++ all-reduce), its stacks are dumped, it is named and killed, and the job
recovers. Real ``elastictk-run`` processes, a real 2-rank DDP job on gloo (CPU), real signals.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastictk.cli import parse_args
from elastictk.cli.args import main_for_test
from elastictk.metrics.events import read_events

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "helpers" / "ddp_progress.py")
RUN = [sys.executable, "-m", "elastictk.run"]


def _launch(tmp: Path, flags: list[str], steps: int, pause: float,
            *script_args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICTK_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    argv = [*RUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
            "--log-dir", str(tmp / "logs"), "--event-log", str(tmp / "events.jsonl"), *flags,
            SCRIPT, str(tmp), str(steps), str(pause), *script_args]
    return subprocess.Popen(argv, env=env, cwd=tmp, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(p: subprocess.Popen[str], timeout: float = 90) -> str:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"elastictk-run did not finish within {timeout}s:\n{out}")
    return out


def _wait_for(path: Path, p: subprocess.Popen[str], timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text().strip():
        if p.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{path.name} never appeared:\n{_finish(p)}")
        time.sleep(0.05)
    return int(path.read_text())


def _events(tmp: Path, kind: str) -> list[dict[str, object]]:
    return [{"mono": e.mono, **e.fields} for e in read_events(tmp / "events.jsonl", {kind})]


def test_a_stopped_ddp_rank_is_named_dumped_killed_and_the_job_recovers(tmp_path: Path) -> None:
    """Attempt 1 then trains 3 s, twice the timeout, without being judged hung."""
    timeout = 1.5
    p = _launch(tmp_path, ["--hang-detection", "fixed", "--progress-timeout", str(timeout),
                           "--collective-timeout", "20"], 60, 0.05)
    pid = _wait_for(tmp_path / "a0.r1.pid", p)
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        out = _finish(p)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)  # only if the watchdog did not (the red side)
        except ProcessLookupError:
            pass
    assert p.returncode == 0, out
    hangs = _events(tmp_path, "hang_detected")
    assert len(hangs) == 1, out
    h = hangs[0]
    assert (h["trigger"], h["rank"], h["pid"], h["culprits"], h["blocked"]) == \
        ("progress", 1, pid, [1], [0]), h
    assert "stopped" in str(h["reason"]) and h["stacks_from"] == "py-spy", h
    # caught within the timeout (counted from the last step, just before the stop) + a margin
    assert timeout <= float(h["idle_s"]) < timeout + 1.5, h  # type: ignore[arg-type]
    assert float(h["mono"]) - stopped_at < timeout + 3.0, h  # type: ignore[arg-type]
    line = next(ln for ln in out.splitlines() if "hang on" in ln)
    assert f"rank 1 (pid {pid}" in line and "blocked waiting on it: ranks 0" in line, line
    report = Path(str(h["report"])).read_text()
    assert report.count("ddp_progress.py") >= 2, report  # both ranks' stacks, rank 1 via py-spy
    assert "CULPRIT" in report and "stacks from py-spy" in report, report
    failed = _events(tmp_path, "worker_failed")
    assert [(f["rank"], f.get("cause")) for f in failed] == [(1, "hang_detected")], failed
    assert len(_events(tmp_path, "restart")) == 1
    assert (tmp_path / "a1.r0.done").exists() and (tmp_path / "a1.r1.done").exists()
    # --collective-timeout became the process group's timeout (the script passed none)
    assert float((tmp_path / "a0.r0.timeout").read_text()) == 20.0


def test_in_place_the_culprit_alone_is_replaced_and_the_survivor_keeps_its_pid(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICTK_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    trace, events = tmp_path / "trace.jsonl", tmp_path / "events.jsonl"
    p = subprocess.Popen(
        [*RUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--recovery", "in-place",
         "--progress-timeout", "1.5", "--log-dir", str(tmp_path / "logs"), "--event-log", str(events),
         str(ROOT / "examples" / "train_inplace.py"), "--steps", "100", "--step-time", "0.03",
         "--trace", str(trace)],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    deadline = time.monotonic() + 60
    while not trace.exists() or len(trace.read_text().splitlines()) < 10:
        if p.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no steps:\n{_finish(p)}")
        time.sleep(0.05)
    pids = {int(k): v for k, v in _events(tmp_path, "workers_started")[0]["pids"].items()}  # type: ignore[attr-defined]
    os.kill(pids[1], signal.SIGSTOP)
    try:
        out = _finish(p)
    finally:
        try:
            os.kill(pids[1], signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert p.returncode == 0, out
    hangs = _events(tmp_path, "hang_detected")
    assert [(h["rank"], h["pid"], h["blocked"]) for h in hangs] == [(1, pids[1], [0])], out
    recovered = _events(tmp_path, "inplace_recovered")
    assert len(recovered) == 1 and recovered[0]["pids"]["0"] == pids[0], recovered  # type: ignore[index]
    assert _events(tmp_path, "restart") == []  # no restart-all


def test_a_rank_that_never_completes_a_first_step_is_a_startup_hang(tmp_path: Path) -> None:
    p = _launch(tmp_path, ["--startup-timeout", "3", "--progress-timeout", "0"], 5, 0.0, "60")
    out = _finish(p)
    assert p.returncode == 0, out
    hangs = _events(tmp_path, "hang_detected")
    assert len(hangs) == 1 and hangs[0]["trigger"] == "startup", out
    assert 1 in hangs[0]["culprits"] and "first step" in str(hangs[0]["reason"]), hangs  # type: ignore[operator]
    assert float(hangs[0]["idle_s"]) < 3.0 + 1.5, hangs  # type: ignore[arg-type]
    assert (tmp_path / "a1.r1.done").exists()
    # without --collective-timeout the process group keeps the backend's default
    assert float((tmp_path / "a1.r0.timeout").read_text()) == 1800.0


def test_fresh_interpreter_workers_count_optimizer_steps(tmp_path: Path) -> None:
    """A worker started as a new interpreter (``--start-method spawn``, ``--no-python`` is not
    Python) gets the optimizer hook from the timer's site dir, which the agent puts on
    PYTHONPATH whenever worker hooks are named; steps land in its slot with their time."""
    from elastictk.agent.watchdog import Watchdog

    wd = Watchdog(1, progress_timeout=60)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICTK_")}
        env = {**wd.worker_env(env), "RANK": "0", "LOCAL_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
        code = ("import torch\nm = torch.nn.Linear(2, 1)\no = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                "for _ in range(3):\n    m(torch.ones(1, 2)).sum().backward()\n    o.step()\n"
                "import time; print(time.monotonic())\n")
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=120, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert wd.progress is not None
        slot = wd.progress.block.snapshot()[0]
        assert slot.steps == 3, (slot, r.stderr)
        assert slot.last_step_mono == float("inf")  # the script ended: not judged any more
    finally:
        wd.close()


@pytest.mark.parametrize("flag,value,needle", [
    ("--progress-timeout", "-1", "--progress-timeout -1: seconds must be a finite number 0 or more"),
    ("--progress-timeout", "abc", "--progress-timeout abc: 'abc' is not a number of seconds"),
    ("--startup-timeout", "nan", "--startup-timeout nan: seconds must be a finite number 0 or more"),
    ("--startup-timeout", "1e12", "--startup-timeout 1e12: seconds must be at most 86400"),
    ("--hang-detection", "learnt", "--hang-detection learnt"),
])
def test_bad_values_are_one_line_errors(flag: str, value: str, needle: str) -> None:
    code, err, config = main_for_test([flag, value, "--standalone", SCRIPT])
    assert (code, config) == (2, None) and "Traceback" not in err, err
    assert err.count("\n") == 1 and needle in err, err


def test_defaults_and_off() -> None:
    c = parse_args(["--standalone", SCRIPT])
    assert (c.hang_detection, c.progress_timeout, c.startup_timeout) == ("learned", None, None)
    c = parse_args(["--hang-detection", "fixed", "--standalone", SCRIPT])
    assert (c.hang_detection, c.progress_timeout) == ("fixed", 300.0)
    c = parse_args(["--progress-timeout", "0", "--startup-timeout", "7.5", "--standalone", SCRIPT])
    assert (c.progress_timeout, c.startup_timeout) == (None, 7.5)


def test_the_event_fields_are_json() -> None:
    from elastictk.agent.hang import Hang, RankState

    r = RankState(1, 3, 42, 7, 2.5, "T", "train.py:9 (main)", "", "py-spy")
    h = Hang("progress", 2.0, (r,), (), "stopped by a signal (state T)", "host", None)
    assert json.loads(json.dumps(h.fields()))["culprits"] == [3]
    assert h.headline() == "rank 3 made no progress for 2.5s at train.py:9 (main) (progress watchdog)"


def test_py_spy_reads_a_stopped_process_and_a_missing_py_spy_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastictk.agent import rankstacks as progress

    code = "import time\ndef parked():\n    print('ready', flush=True)\n    time.sleep(60)\nparked()"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        os.kill(p.pid, signal.SIGSTOP)
        text, note = progress.pyspy_dump(p.pid, stopped=True)
        assert "parked" in text and note == "", note
        monkeypatch.setattr(progress, "pyspy_path", lambda: None)
        assert progress.pyspy_dump(p.pid, stopped=True) == (
            "", "stacks not available: py-spy is not installed (pip install py-spy)")
    finally:
        p.kill()
        p.communicate()

"""--max-no-progress-restarts: K restarts in a row without a completed step end the job.

The counting is pure (``CrashLoop`` in the restart policy) and checked here by properties
against a model written differently (the trailing run of failures); the wiring by real
``elastictk-run`` jobs whose workers count steps through the shared steps block.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.agent.policy import (
    CrashLoop, Failure, GiveUp, MembershipChange, PolicyState, Restart, RestartPolicy,
)

RUN = str(Path(sys.executable).parent / "elastictk-run")

progress_flags = st.lists(st.sampled_from([True, False, None]), min_size=1, max_size=30)


def model_gives_up_at(flags: list[Optional[bool]], k: int) -> Optional[int]:
    """The index of the failure that ends the job: walk back from each failure over those
    without progress (an unknown one is passed over) to the last with progress; the failures
    passed that followed a restart (every one but the job's very first) are the count."""
    for i in range(len(flags)):
        if flags[i] is not False:
            continue
        n, j = 0, i
        while j >= 0 and flags[j] is not True:
            n += 1 if flags[j] is False and j > 0 else 0
            j -= 1
        if n >= k:
            return i
    return None


@settings(max_examples=300, deadline=None)
@given(progress_flags, st.integers(min_value=1, max_value=5))
def test_gives_up_exactly_where_the_model_says(flags: list[Optional[bool]], k: int) -> None:
    policy = RestartPolicy(max_restarts=None, crash_loop=k)
    causes = [f"cause {i}" for i in range(len(flags))]
    _, decisions = policy.run(Failure(float(i), causes[i], p) for i, p in enumerate(flags))
    want = model_gives_up_at(flags, k)
    if want is None:
        assert all(isinstance(d, Restart) for d in decisions)
        return
    assert len(decisions) == want + 1 and all(isinstance(d, Restart) for d in decisions[:-1])
    last = decisions[-1]
    assert isinstance(last, GiveUp)
    restarts = "1 restart" if k == 1 else f"{k} restarts"
    assert last.reason.startswith(f"crash loop: {restarts} without a completed step; first failure: ")
    # the first failure is the first without progress since the last one with progress
    start = max((i for i in range(want) if flags[i] is True), default=-1) + 1
    first = next(i for i in range(start, want + 1) if flags[i] is False)
    assert f"first failure: {causes[first]};" in last.reason


@settings(max_examples=200, deadline=None)
@given(progress_flags, st.integers(min_value=1, max_value=5))
def test_through_the_store_json_the_same(flags: list[Optional[bool]], k: int) -> None:
    """The job-wide state lives in the store as JSON: a decision on the re-read state is the same."""
    policy = RestartPolicy(max_restarts=None, crash_loop=k)
    direct, stored = policy.initial_state(), policy.initial_state()
    for i, p in enumerate(flags):
        direct, d1 = policy.decide(direct, Failure(float(i), "c", p))
        stored, d2 = policy.decide(PolicyState.from_json(stored.to_json()), Failure(float(i), "c", p))
        assert d1 == d2 and direct == stored
        if isinstance(d1, GiveUp):
            break


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["F", "M"]), max_size=20), st.integers(min_value=0, max_value=8))
def test_unknown_progress_changes_nothing(kinds: list[str], budget: int) -> None:
    """Failures whose progress is unknown (no steps block; in-place recoveries) neither count
    nor reset: the policy decides as it would without the limit."""
    events = [Failure(float(i), "c") if x == "F" else MembershipChange(float(i)) for i, x in enumerate(kinds)]
    with_limit = RestartPolicy(max_restarts=budget, crash_loop=1).run(events)[1]
    without = RestartPolicy(max_restarts=budget).run(events)[1]
    assert with_limit == without


def test_the_limit_wins_over_a_budget_left_and_progress_resets() -> None:
    policy = RestartPolicy(max_restarts=100, crash_loop=2)
    s, d = policy.run([Failure(0, "a", False), Failure(1, "b", False), Failure(2, "c", True),
                       Failure(3, "d", False)])
    assert all(isinstance(x, Restart) for x in d) and s.stalled == 1 and s.stall_first == "d"
    s, last = policy.decide(s, Failure(4, "e", False))
    assert isinstance(last, GiveUp) and "first failure: d;" in last.reason and s.failures == 5


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_bad_limits_are_one_line(bad: object) -> None:
    with pytest.raises(ValueError, match="--max-no-progress-restarts must be a whole number >= 1"):
        CrashLoop(bad)  # type: ignore[arg-type]


def test_old_state_records_read_as_no_count() -> None:
    old = {k: v for k, v in PolicyState(failures=2).to_json().items() if not k.startswith("stall")}
    assert PolicyState.from_json(old) == PolicyState(failures=2)
    with pytest.raises(ValueError, match="'stalled' must be an int"):
        PolicyState.from_json({**old, "stalled": -1})


# ---------------------------------------------------------------- real jobs
def _run(tmp_path: Path, script: str, *flags: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.run([RUN, "--standalone", "--nproc-per-node", "2", "--start-method", "spawn",
                           "--log-dir", str(tmp_path / "logs"), *flags, str(path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_a_script_that_never_steps_ends_after_k_restarts(tmp_path: Path) -> None:
    p = _run(tmp_path, "import sys\nsys.exit(3)\n", "--nproc-per-node", "1",
             "--max-restarts", "10", "--max-no-progress-restarts", "2")
    assert p.returncode == 1, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert ("crash loop: 2 restarts without a completed step; first failure: rank " in last
            and "exit code 3 (a start-up failure: before any rank's first step)" in last), last
    assert p.stderr.count("restart restart_count=") == 2, p.stderr[-3000:]  # not 10
    assert "phase=startup" in p.stderr


def test_a_script_that_steps_then_crashes_is_restarted(tmp_path: Path) -> None:
    """Steps are counted without the progress watchdog too (the agent's own steps block)."""
    p = _run(tmp_path, """\
        import os, sys
        import elastictk.metrics
        elastictk.metrics.step()
        sys.exit(1 if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < 3 else 0)
        """, "--max-restarts", "3", "--max-no-progress-restarts", "1", "--progress-timeout", "0")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count("restart restart_count=") == 3 and "phase=training" in p.stderr
    assert "crash loop" not in p.stderr


@pytest.mark.parametrize("bad", ["-1", "x"])
def test_bad_flag_values_are_one_line(tmp_path: Path, bad: str) -> None:
    p = subprocess.run([RUN, "--standalone", "--max-no-progress-restarts", bad, "train.py"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "--max-no-progress-restarts" in p.stderr

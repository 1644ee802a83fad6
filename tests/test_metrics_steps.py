"""Worker progress through the shared steps block: real worker processes, real restarts."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.metrics import worker as worker_mod
from elastictk.metrics.layout import STEP_BUCKETS, SlotSnapshot, bucket_index
from elastictk.metrics.steps import WorkerStepsBlock, goodput, lost, totals

ROOT = Path(__file__).resolve().parent.parent


def run_worker(code: str, env: dict[str, str], local_rank: int = 0,
               timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != worker_mod.ENV_PATH}
    full.update(env, LOCAL_RANK=str(local_rank))
    r = subprocess.run([sys.executable, "-c", code], env=full, cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r


STEPS = """
import elastictk.metrics as etm
n, timed, ckpt_at = {n}, {timed}, {ckpt_at}
for i in range(n):
    if timed:
        with etm.step_timer():
            pass
    else:
        etm.step()
    if i + 1 == ckpt_at:
        etm.checkpoint()
print(etm.enabled())
"""


@pytest.mark.parametrize("backing", ["memfd", "shm"])
def test_workers_report_steps_into_their_own_slot(backing: str) -> None:
    with WorkerStepsBlock(3, backing=backing) as block:
        if backing == "shm":
            assert Path(block.path).exists() and block.path.startswith("/dev/shm/elastictk-")
        r = run_worker(STEPS.format(n=7, timed=True, ckpt_at=0), block.env(), local_rank=1)
        run_worker(STEPS.format(n=4, timed=False, ckpt_at=0), block.env(), local_rank=2)
        assert r.stdout.strip() == "True"
        s0, s1, s2 = block.snapshot()
        assert not s0.used and s0.steps == 0
        assert (s1.steps, s1.timed_steps, sum(s1.buckets)) == (7, 7, 7)
        assert (s2.steps, s2.timed_steps) == (4, 3)  # step(): the first has no previous step
        assert s1.last_step_wall > 0 and s1.seconds >= 0
        t = totals(block.snapshot(), block.epoch)
        assert (t.steps, t.reporting, t.lost_steps) == (11, 2, 0)
    if backing == "shm":
        assert not Path(block.path).exists()  # close() unlinked it
    assert block.snapshot() == [] and block.closed


def test_without_the_env_var_every_call_is_a_no_op() -> None:
    r = run_worker("import elastictk.metrics as etm\n"
                   "etm.step(); etm.checkpoint()\n"
                   "with etm.step_timer(): pass\n"
                   "print(etm.enabled())", {})
    assert r.stdout.strip() == "False" and r.stderr == ""


@pytest.mark.parametrize("case", ["missing", "rank"])
def test_a_bad_block_is_one_line_on_stderr_and_steps_go_on(tmp_path: Path, case: str) -> None:
    with WorkerStepsBlock(1) as block:
        env = {worker_mod.ENV_PATH: str(tmp_path / "gone") if case == "missing" else block.path}
        r = run_worker("import elastictk.metrics as etm\nfor _ in range(3): etm.step()\nprint(etm.enabled())",
                       env, local_rank=0 if case == "missing" else 5)
        assert r.stdout.strip() == "False"
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "steps are not reported" in lines[0]
        assert ("No such file" in lines[0]) if case == "missing" else ("LOCAL_RANK 5" in lines[0])
        assert block.snapshot()[0].steps == 0


def test_a_step_that_raises_is_not_counted() -> None:
    with WorkerStepsBlock(1) as block:
        run_worker("import elastictk.metrics as etm\n"
                   "for i in range(4):\n"
                   "    try:\n"
                   "        with etm.step_timer():\n"
                   "            if i % 2: raise ValueError\n"
                   "    except ValueError: pass\n", block.env())
        assert block.snapshot()[0].steps == 2


def test_a_restart_loses_the_steps_after_the_last_checkpoint() -> None:
    """Attempt 1: 10 steps, checkpoint after 6, then the attempt fails; attempt 2 resumes."""
    with WorkerStepsBlock(1) as block:
        run_worker(STEPS.format(n=10, timed=True, ckpt_at=6), block.env())
        before = totals(block.snapshot(), block.epoch)
        assert before.lost_steps == 0  # still the running attempt: nothing is lost yet
        block.end_attempt()  # the agent saw a failure
        ended = totals(block.snapshot(), block.epoch)
        assert ended.lost_steps == 4 and ended.lost_seconds <= ended.seconds
        run_worker(STEPS.format(n=5, timed=True, ckpt_at=0), block.env())  # the restarted worker
        after = totals(block.snapshot(), block.epoch)
        (slot,) = block.snapshot()
        assert slot.lost_steps == 4  # settled into the slot when the new process attached
        assert (after.steps, after.lost_steps) == (15, 4)
        assert after.lost_seconds == pytest.approx(ended.lost_seconds)
        assert slot.epoch == block.epoch == 1


def test_a_worker_killed_mid_run_leaves_a_readable_slot() -> None:
    with WorkerStepsBlock(1) as block:
        p = subprocess.Popen(
            [sys.executable, "-c", "import elastictk.metrics as etm, sys\n"
             "etm.step(); print('go', flush=True)\n"
             "while True: etm.step()"],
            env={**os.environ, **block.env(), "LOCAL_RANK": "0"}, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == "go"
            deadline = time.monotonic() + 60
            while block.snapshot()[0].steps < 1000 and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            p.kill()
            p.wait(timeout=30)
            assert p.stdout is not None
            p.stdout.close()
        killed = block.snapshot()[0]
        assert killed.steps >= 1000
        block.end_attempt()
        run_worker(STEPS.format(n=3, timed=True, ckpt_at=3), block.env())
        (slot,) = block.snapshot()
        assert slot.steps == killed.steps + 3 and slot.owner != killed.owner
        assert slot.lost_steps == killed.proc_steps and slot.checkpoints == 1


FORK = """
import os, elastictk.metrics as etm
etm.step()
pid = os.fork()
if pid == 0:
    etm.step(); etm.step()  # a forked helper is not the slot's owner
    os._exit(0 if not etm.enabled() else 1)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0
etm.step()
"""


def test_a_process_forked_from_a_worker_does_not_report() -> None:
    with WorkerStepsBlock(1) as block:
        run_worker(FORK, block.env())
        assert block.snapshot()[0].steps == 2


STRACED = """
import os, elastictk.metrics as etm
etm.step()
os.access("/elastictk-begin", os.F_OK)
for _ in range(10000):
    etm.step()
os.access("/elastictk-end", os.F_OK)
"""


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_a_step_makes_no_system_call(tmp_path: Path) -> None:
    out = tmp_path / "trace"
    with WorkerStepsBlock(1) as block:
        env = {**os.environ, **block.env(), "LOCAL_RANK": "0"}
        r = subprocess.run(["strace", "-o", str(out), sys.executable, "-c", STRACED], env=env,
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        if r.returncode != 0 and not out.exists():
            pytest.skip(f"strace cannot trace here: {r.stderr.strip()[-200:]}")
        assert r.returncode == 0, r.stderr
        assert block.snapshot()[0].steps == 10001
    lines = out.read_text().splitlines()
    begin = next(i for i, line in enumerate(lines) if "/elastictk-begin" in line)
    end = next(i for i, line in enumerate(lines) if "/elastictk-end" in line)
    between = lines[begin + 1:end]
    assert len(between) < 50, between[:20]  # 10,000 steps; the odd allocator call is fine


def test_slot_layout_bucket_edges_are_inclusive() -> None:
    for i, bound in enumerate(STEP_BUCKETS):
        assert bucket_index(bound) == i
        assert bucket_index(bound * 1.0001) == i + 1
    assert bucket_index(1e9) == len(STEP_BUCKETS)


# -- goodput arithmetic, against a model --------------------------------------------------------

ops = st.lists(st.one_of(
    st.tuples(st.just("step"), st.floats(0.0, 5.0)),
    st.tuples(st.just("checkpoint"), st.just(0.0)),
    st.tuples(st.just("fail"), st.just(0.0)),  # the agent ends the attempt
    st.tuples(st.just("restart"), st.just(0.0)),  # a new process attaches to the slot
), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_lost_and_useful_time_match_a_model(sequence: list[tuple[str, float]]) -> None:
    """In-process slot writers stand in for worker processes: each "restart" is a new writer."""
    with WorkerStepsBlock(1) as block:
        writer = worker_mod._Slot(block.path, 0)
        model_total = model_lost = pending = 0.0
        ended = False
        for op, x in sequence:
            if op == "step":
                writer.record(x)
                model_total += x
                pending += x
                if ended:
                    model_lost += x  # steps of a process whose attempt already ended are lost
            elif op == "checkpoint":
                writer.checkpoint()
                if ended:
                    model_lost -= pending  # a checkpoint after the end still saves them
                pending = 0.0
            elif op == "fail":
                block.end_attempt()
                if not ended:
                    model_lost += pending
                ended = True
            else:
                writer = worker_mod._Slot(block.path, 0)
                if not ended:
                    model_lost += pending
                pending, ended = 0.0, False
            t = totals(block.snapshot(), block.epoch)
            assert t.seconds == pytest.approx(model_total, abs=1e-6)
            assert t.lost_seconds == pytest.approx(model_lost, abs=1e-6)
            assert 0.0 <= t.lost_seconds <= t.seconds + 1e-6
            g = goodput(t, elapsed=max(model_total, 1.0))
            assert g is None or 0.0 <= g <= 1.0
        del writer


slots = st.builds(
    SlotSnapshot, local_rank=st.integers(0, 7), owner=st.integers(0, 3), epoch=st.integers(0, 3),
    steps=st.integers(0, 100), seconds=st.floats(0, 100), proc_steps=st.integers(0, 50),
    proc_seconds=st.floats(0, 50), ckpt_steps=st.integers(0, 50), ckpt_seconds=st.floats(0, 50),
    lost_steps=st.integers(0, 50), lost_seconds=st.floats(0, 50),
)


@given(st.lists(slots, max_size=6), st.integers(0, 5), st.floats(0, 1e6))
def test_goodput_is_a_share_and_losses_only_grow_with_the_epoch(s: list[SlotSnapshot], epoch: int,
                                                                elapsed: float) -> None:
    g = goodput(totals(s, epoch), elapsed)
    assert g is None or 0.0 <= g <= 1.0
    for slot in s:
        assert lost(slot, epoch)[1] <= lost(slot, epoch + 1)[1]
        assert lost(slot, epoch)[0] >= slot.lost_steps

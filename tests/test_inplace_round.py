"""The agent's side of in-place recovery with real workers and a real in-place store, driven
step by step, so orderings the launcher only hits under load are hit every time."""
from __future__ import annotations

import contextlib
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from elastictk.agent.rankstacks import pyspy_path
from elastictk.agent.unformed import REPORT, joined_count, summary
from elastictk.inplace.protocol import ENV_FIRST_GEN, joined_key, ready_key, ready_value
from elastictk.store import FileStore, TCPStore
from elastictk.agent.inplace import InPlaceRound
from elastictk.agent.inplace_host import Setup
from elastictk.supervisor.group import WorkerGroup
from elastictk.agent.policy import RestartPolicy
from elastictk.supervisor.spec import WorkerSpec
from tests.test_worker_group import assignment

Events = list[tuple[str, dict[str, Any]]]


@contextlib.contextmanager
def round_of_two(tmp_path: Path, max_restarts: int, reform_timeout: float = 30.0,
                 argv: tuple[str, ...] = ("/bin/sh", "-c", "exec sleep 600"),
                 ) -> Iterator[tuple[WorkerGroup, InPlaceRound, Events]]:
    """Two sleeping workers under one agent's in-place round, with a real in-place store."""
    events: Events = []
    server = TCPStore.serve("127.0.0.1", 0)
    job = FileStore(tmp_path / "job")
    spec = WorkerSpec(list(argv), local_world_size=2)
    setup = Setup(f"127.0.0.1:{server.port}", "round1", 0, False)
    try:
        with WorkerGroup(spec, tmp_path / "logs") as group:
            group.start(0, assignment(group_rank=0, nodes=1))
            rnd = InPlaceRound(group, job, RestartPolicy(max_restarts=max_restarts), setup, 2,
                               {"n0": 0}, emit=lambda kind, **kw: events.append((kind, kw)),
                               reform_timeout=reform_timeout)
            try:
                yield group, rnd, events
            finally:
                rnd.close()
                group.stop(grace=5)
    finally:
        job.close()
        server.close()


def test_a_failure_after_the_generation_formed_is_charged_even_before_the_agent_saw_it(
        tmp_path: Path) -> None:
    """The replacement's generation is ready in the store, but the agent's monitor has not yet
    handled the watcher's wake-up when the next worker fails: that failure is a new one (a
    second charge, here past --max-restarts=1), not the tail of the first recovery."""
    with round_of_two(tmp_path, max_restarts=1) as (group, rnd, events):
        group.signal_one(0, signal.SIGKILL)
        first = group.wait_any(timeout=30)
        assert rnd.on_failures(first) and rnd.pending == 1
        assert rnd.decision is not None and rnd.decision.restart_count == 1
        rnd.store.set(ready_key(1), b"1")  # the workers formed generation 1
        group.signal_one(1, signal.SIGKILL)
        second = group.wait_any(timeout=30)
        assert [r.local_rank for r in second] == [1]
        assert not rnd.on_failures(second)
        assert rnd.decision is not None and rnd.decision.action == "give_up"
        kinds = [k for k, _ in events]
        assert "inplace_fallback" not in kinds
        assert kinds.index("inplace_recovered") < len(kinds) - 1
        assert kinds[-1] == "worker_failed" and events[-1][1]["local_rank"] == 1


def test_a_recovery_is_timed_to_when_the_group_formed_not_to_when_the_agent_noticed(
        tmp_path: Path) -> None:
    """The agent's watcher re-arms every 0.1 s and its monitor may be busy: ``took_ms`` comes
    from the ready key's stamp, so a late look does not lengthen the recovery it reports."""
    with round_of_two(tmp_path, max_restarts=3) as (group, rnd, events):
        group.signal_one(0, signal.SIGKILL)
        assert rnd.on_failures(group.wait_any(timeout=30))
        rnd.store.set(ready_key(1), ready_value(time.time()))  # formed now...
        time.sleep(0.5)  # ...and seen half a second later
        assert not rnd.poll()
        recovered = [kw for k, kw in events if k == "inplace_recovered"]
        assert len(recovered) == 1 and recovered[0]["generation"] == 1
        assert 0 <= recovered[0]["took_ms"] < 300, recovered


SLEEPER = (sys.executable, "-c", "import time\ndef waiting():\n    time.sleep(600)\nwaiting()")


def test_a_generation_that_never_forms_falls_back_with_how_far_it_got_and_every_stack(
        tmp_path: Path) -> None:
    """The replacement's generation never becomes ready (one rank of two joined): past the
    re-form deadline the agent falls back, and first writes what the fallback is about to
    kill, the joined count and each local worker's stacks, and its line points there."""
    with round_of_two(tmp_path, max_restarts=1, reform_timeout=0.5, argv=SLEEPER) as (group, rnd, events):
        group.signal_one(0, signal.SIGKILL)
        assert rnd.on_failures(group.wait_any(timeout=30)) and rnd.pending == 1
        rnd.store.add(joined_key(1), 1)
        deadline = time.monotonic() + 120  # 0.5 s of an idle host's time, however busy this one is
        while not rnd.poll():
            assert time.monotonic() < deadline, events
            time.sleep(0.05)
        pids = group.pids()
        reason = [kw["reason"] for kind, kw in events if kind == "inplace_fallback"]
        assert len(reason) == 1 and reason[0].startswith("generation 1 not ready within 0.5s"), reason
        assert "1 of 2 ranks had joined generation 1" in reason[0], reason
        path = Path(reason[0].rsplit("stacks in ", 1)[1])
        assert path == group.attempt_dir / REPORT
        text = path.read_text()
        assert text.startswith("in-place generation 1 not ready within 0.5s"), text
        for lr, pid in pids.items():
            assert f"(local {lr}, pid {pid}, state " in text, text
        if pyspy_path() is not None:  # installed with elastictk; the dump shows where each waits
            assert text.count("waiting (<string>:3)") == 2, text


def test_an_unreadable_joined_count_is_named_as_such() -> None:
    assert summary(3, joined_count(b"not a number"), 4) == "an unreadable count of 4 ranks had joined generation 3"
    assert summary(3, joined_count(None), 4) == "0 of 4 ranks had joined generation 3"  # nobody added yet
    assert summary(3, joined_count(b"-1"), 4).startswith("an unreadable count")
    assert summary(3, joined_count(b"2"), 4) == "2 of 4 ranks had joined generation 3"


def test_a_replacement_waits_for_the_generation_about_to_be_published(tmp_path: Path) -> None:
    """A replacement (a standby is quick) may look for its generation before the agent's thread
    has published it: its first generation is the new one, so it waits for that record and
    never joins the round's older generation, whose group is gone. Red before: it got the
    round's first generation (0), joined generation 0 on a loaded host and dialled the
    survivor's closed gen-0 listener while the survivor waited for it in generation 1."""
    with round_of_two(tmp_path, max_restarts=2) as (group, rnd, events):
        group.signal_one(1, signal.SIGKILL)
        assert rnd.on_failures(group.wait_any(timeout=30)) and rnd.pending == 1
        pid = group.pids()[1]
        # Read once the replacement is the final program: between fork and the shell's `exec
        # sleep` its environment reads as the parent's, and during an exec as empty (a CI run
        # read {} there).
        deadline = time.monotonic() + 60
        while Path(f"/proc/{pid}/comm").read_text().strip() != "sleep":
            assert time.monotonic() < deadline, "the replacement never became `sleep`"
            time.sleep(0.01)
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        assert env.get(ENV_FIRST_GEN.encode()) == b"1", env.get(ENV_FIRST_GEN.encode())


def test_a_recovery_is_timed_from_when_its_replacements_began_to_start(tmp_path: Path) -> None:
    """``took_ms`` (generation formed) counts from the replacements' start, so it includes
    ``spawn_ms``: the recovery's restore phase is the difference. Red before: the deadline's
    start reset the clock after the spawn, and a generation formed quickly read as formed
    before its replacement had started (a restore phase of 0, the recovery short by the spawn)."""
    with round_of_two(tmp_path, max_restarts=1) as (group, rnd, events):
        group.signal_one(0, signal.SIGKILL)
        assert rnd.on_failures(group.wait_any(timeout=30)) and rnd.pending == 1
        rnd.store.set(ready_key(1), ready_value(time.time()))  # the workers formed it at once
        deadline = time.monotonic() + 60
        while not any(kind == "inplace_recovered" for kind, _ in events):
            assert time.monotonic() < deadline and not rnd.poll(), events
            time.sleep(0.01)
        spawn = next(kw["spawn_ms"] for kind, kw in events if kind == "inplace_recovery")
        took = next(kw["took_ms"] for kind, kw in events if kind == "inplace_recovered")
        assert took >= spawn > 0, (spawn, took)

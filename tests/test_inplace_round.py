"""The agent's side of in-place recovery with real workers and a real in-place store, driven
step by step, so orderings the launcher only hits under load are hit every time."""
from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path
from typing import Any, Iterator

from elastictk.inplace.protocol import ready_key, ready_value
from elastictk.store import FileStore, TCPStore
from elastictk.agent.inplace import InPlaceRound
from elastictk.agent.inplace_host import Setup
from elastictk.supervisor.group import WorkerGroup
from elastictk.agent.policy import RestartPolicy
from elastictk.supervisor.spec import WorkerSpec
from tests.test_worker_group import assignment

Events = list[tuple[str, dict[str, Any]]]


@contextlib.contextmanager
def round_of_two(tmp_path: Path, max_restarts: int) -> Iterator[tuple[WorkerGroup, InPlaceRound, Events]]:
    """Two sleeping workers under one agent's in-place round, with a real in-place store."""
    events: Events = []
    server = TCPStore.serve("127.0.0.1", 0)
    job = FileStore(tmp_path / "job")
    spec = WorkerSpec(["/bin/sh", "-c", "exec sleep 600"], local_world_size=2)
    setup = Setup(f"127.0.0.1:{server.port}", "round1", 0, False)
    try:
        with WorkerGroup(spec, tmp_path / "logs") as group:
            group.start(0, assignment(group_rank=0, nodes=1))
            rnd = InPlaceRound(group, job, RestartPolicy(max_restarts=max_restarts), setup, 2,
                               {"n0": 0}, emit=lambda kind, **kw: events.append((kind, kw)))
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

"""The fence's one line names the cause: a heartbeat thread that never ran (an overloaded host)
is not "the network", and a store that refused the beat is named by its error."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from elastictk.rendezvous import MembershipWatch, RendezvousHandler
from elastictk.store import FileStore, StoreUnreachable
from tests.test_rendezvous import fast


@pytest.mark.parametrize("cause", ["starved", "refused"])
def test_the_fence_says_why_the_heartbeat_stopped(tmp_path: Path, cause: str) -> None:
    h = RendezvousHandler(FileStore(tmp_path / "store", timeout=20),
                          fast("fence", 1, 1, heartbeat_interval=0.5, heartbeat_timeout=3.0), node_id="a")
    watch = None
    try:
        info = h.next_round()
        hb = h._heartbeat
        assert hb is not None
        if cause == "starved":  # the heartbeat thread is not scheduled for 8 s, once
            wait, held = hb._stop.wait, threading.Event()

            def held_off(timeout: float | None = None) -> bool:
                if not held.is_set():
                    held.set()
                    return wait(8.0)
                return wait(timeout)
            hb._stop.wait = held_off  # type: ignore[method-assign]
        else:  # the thread runs, the store refuses every beat
            def refuse(key: str, amount: int) -> int:
                raise StoreUnreachable("store at 10.9.9.9: connection refused")
            hb._store.add = refuse  # type: ignore[method-assign]
        watch = MembershipWatch(h, info)
        assert watch.wait(60), "the fence never fired"
        reason = watch.reason or ""
        assert "heartbeat has not reached the rendezvous store" in reason, reason
        if cause == "starved":
            assert "did not run" in reason and "overloaded" in reason and "heartbeat_timeout" in reason, reason
        else:
            assert "the last attempt: store at 10.9.9.9: connection refused" in reason, reason
            assert "did not run" not in reason, reason
    finally:
        if watch is not None:
            watch.stop(wait=True)
        h.close(leaving=False)

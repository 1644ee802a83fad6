"""The reaper sleeps until the earliest deadline it knows of (at most its idle interval) and a
worker arming a timer due sooner wakes it: an idle job costs a wake-up per interval, not a
hundred a second, and a short timer armed while the reaper sleeps is still caught on time."""
from __future__ import annotations

import signal
import time
from pathlib import Path

from elastictk.timer import TimerServer
from elastictk.timer import layout as L
from tests.test_timer import Worker, only_expiry, start, wait_until
from tests.test_timer import workers  # noqa: F401  (the fixture)

SLEEPER = """
print("attached" if timer.expires(after=1)(lambda: True)() else "", flush=True)
time.sleep(60)
"""

SHORT_AFTER_IDLE = """
timer.expires(after=30, scope="warm-up")(lambda: None)()  # attach; the reaper learns of us
print("idle", flush=True)
while not os.path.exists(os.environ["GO"]):
    time.sleep(0.01)
with timer.expires(after=0.3, scope="short"):
    time.sleep(60)
"""


def test_an_idle_reaper_wakes_once_per_interval(tmp_path: Path, workers: list[Worker]) -> None:  # noqa: F811
    with TimerServer(1, scan_interval=1.0) as server:
        w = start(workers, tmp_path, "sleeper", SLEEPER, server)
        server.watch({0: w.proc.pid})
        assert w.read_line() == "attached"
        time.sleep(0.5)
        before = server.stats["scans"]
        time.sleep(3.0)
        scans = server.stats["scans"] - before
        assert 1 <= scans <= 6, f"{scans} scans in 3 s: the reaper polls instead of sleeping"


def test_a_short_timer_armed_while_the_reaper_sleeps_wakes_it(
        tmp_path: Path, workers: list[Worker]) -> None:  # noqa: F811
    # A long idle interval: without the wake-up the timer would be seen up to 10 s late.
    with TimerServer(1, scan_interval=10.0) as server:
        go = tmp_path / "go"
        w = start(workers, tmp_path, "short", SHORT_AFTER_IDLE, server, extra_env={"GO": str(go)})
        server.watch({0: w.proc.pid})
        assert w.read_line() == "idle"
        wait_until(lambda: server.stats["scans"] >= 2, what="the reaper to settle")
        promised = L.U64.unpack_from(server._buf, L.OFF_NEXT_SCAN)[0]
        assert promised - time.monotonic_ns() > 5e9, "the reaper does not plan a long sleep"
        go.touch()
        assert w.wait(timeout=30) == -signal.SIGKILL
        e = only_expiry(server)
        assert e.scope == "short"
        assert e.late_s < 1.0, f"caught {e.late_s:.2f} s late: the worker did not wake the reaper"

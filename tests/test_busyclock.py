"""The in-place re-form deadline in an idle host's seconds (elastictk/lifetime/busyclock.py).

Pure: a fake clock and a fake load average. What it must hold: on an idle host it is the
wall-clock bound it replaced; on a busy one it never fires sooner than that and always fires by
MAX_STRETCH times it (a wedge is still caught); it follows the load as it changes.
"""
from __future__ import annotations

import math

from hypothesis import given, strategies as st

from elastictk.lifetime.busyclock import MAX_STRETCH, BusyDeadline, host_load, stretch


class Host:
    def __init__(self, load: float = 0.0, cores: int = 2) -> None:
        self.now, self.load, self.cores = 100.0, load, cores

    def clock(self) -> float:
        return self.now

    def loadavg(self) -> tuple[float, int]:
        return self.load, self.cores


def test_an_idle_host_fires_at_the_timeout() -> None:
    host = Host(load=0.5)
    d = BusyDeadline(30, host.clock, host.loadavg)
    host.now += 29.9
    assert not d.expired() and math.isclose(d.remaining(), 0.1, abs_tol=1e-9)
    host.now += 0.1
    assert d.expired()
    assert d.describe() == "30s"


def test_a_busy_host_stretches_it_by_its_load_and_says_so() -> None:
    host = Host(load=6.0, cores=2)  # three runnable tasks per core: a third of a core each
    d = BusyDeadline(30, host.clock, host.loadavg)
    host.now += 89
    assert not d.expired(), "89 s at load 6 on 2 cores are under 30 s of an idle host's"
    assert math.isclose(d.remaining(), 1.0, abs_tol=1e-9)
    host.now += 1
    assert d.expired()
    assert d.describe() == "30s of an idle host's time (90s by the clock: load average 6.0 on 2 cores)"


def test_a_wedge_on_the_busiest_host_is_caught_within_the_cap() -> None:
    host = Host(load=500.0, cores=2)
    d = BusyDeadline(30, host.clock, host.loadavg)
    host.now += 30 * MAX_STRETCH
    assert d.expired()


def test_the_load_is_integrated_as_it_changes() -> None:
    host = Host(load=0.0)
    d = BusyDeadline(30, host.clock, host.loadavg)
    host.now += 10
    assert not d.expired()  # 10 idle seconds counted
    host.load = 4.0  # twice the cores: half a second per second
    host.now += 30
    assert not d.expired()  # 10 + 15 = 25
    assert math.isclose(d.remaining(), 10.0)  # 5 idle seconds at 2x
    host.now += 10
    assert d.expired()


@given(st.floats(allow_nan=True, allow_infinity=True), st.integers(min_value=-2, max_value=512))
def test_stretch_is_between_one_and_the_cap(load: float, cores: int) -> None:
    s = stretch(load, cores)
    assert 1.0 <= s <= MAX_STRETCH


@given(timeout=st.floats(min_value=0.1, max_value=600),
       steps=st.lists(st.tuples(st.floats(min_value=0, max_value=50), st.floats(min_value=0, max_value=1000)),
                      min_size=1, max_size=40))
def test_never_sooner_than_the_timeout_always_by_the_cap(timeout: float, steps: list[tuple[float, float]]) -> None:
    """Whatever the load does, the deadline fires no sooner than ``timeout`` wall seconds after
    it began and no later than ``MAX_STRETCH * timeout`` (polled at every change of load)."""
    host = Host()
    d = BusyDeadline(timeout, host.clock, host.loadavg)
    start = host.now
    for dt, load in steps:
        host.now += dt
        fired = d.expired()
        waited = host.now - start
        if waited < timeout * (1 - 1e-9):
            assert not fired
        if waited >= timeout * MAX_STRETCH * (1 + 1e-9):
            assert fired
        host.load = load


def test_the_real_host_load_is_read() -> None:
    load, cores = host_load()
    assert load >= 0 and cores >= 1

"""The learned hang deadline (elastictk/agent/pace.py) over synthetic interval streams: never
under the floor, never over the ceiling, follows a job that slows down 3x gradually, and is not
dragged up by one outlier beyond its quantile."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from elastictk.agent.pace import FACTOR, FLOOR, MIN_SAMPLES, WARMUP, Estimator, Pace, quantile

gaps = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
ceilings = st.floats(min_value=0.5, max_value=1e5, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(gaps, min_size=WARMUP + MIN_SAMPLES - 3, max_size=700), ceilings, st.floats(min_value=0.1, max_value=30))
def test_never_under_the_floor_nor_over_the_ceiling(samples: list[float], ceiling: float, floor: float) -> None:
    est = Estimator(ceiling=ceiling, floor=floor)
    for s in samples:
        est.add(s)
        d = est.deadline()
        assert d <= ceiling
        assert d >= min(floor, ceiling)
        if not est.learned:
            assert d == ceiling  # warm-up and too few samples: the fixed value


@settings(max_examples=150, deadline=None)
@given(base=st.floats(min_value=0.01, max_value=20), n=st.integers(min_value=60, max_value=1500),
       jitter=st.lists(st.floats(min_value=0.9, max_value=1.1), min_size=1, max_size=50),
       ceiling=st.floats(min_value=1000, max_value=1e5))
def test_a_job_slowing_down_3x_gradually_is_never_past_its_deadline(
        base: float, n: int, jitter: list[float], ceiling: float) -> None:
    est = Estimator(ceiling=ceiling)
    warm = WARMUP + MIN_SAMPLES
    for i in range(warm):  # the job's first pace
        est.add(base * jitter[i % len(jitter)])
    for i in range(n):  # then 1x -> 3x over n samples, each within +-10% of the trend
        pace = base * 3 ** ((i + 1) / n) * jitter[(i + warm) % len(jitter)]
        assert pace <= est.deadline(), (i, pace, est.deadline())
        est.add(pace)
    assert est.deadline() >= min(ceiling, 3 * base * 0.9 * FACTOR * 0.9 / 1.1)  # it followed


@settings(max_examples=150, deadline=None)
@given(normal=st.lists(st.floats(min_value=0.001, max_value=50), min_size=100, max_size=500),
       outlier=st.floats(min_value=0, max_value=1e9), at=st.floats(min_value=0, max_value=1))
def test_one_outlier_does_not_drag_the_deadline_up(normal: list[float], outlier: float, at: float) -> None:
    est = Estimator(ceiling=1e12, warmup=0)
    i = int(at * len(normal))
    est.extend([*normal[:i], outlier, *normal[i:]])
    assert est.deadline() <= max(FLOOR, FACTOR * max(normal))


def test_a_learned_deadline_is_the_quantile_times_the_factor_and_kinds_are_apart() -> None:
    pace = Pace(ceiling=300)
    assert pace.deadline("progress") == 300 and not pace.learned("progress")
    pace.add("progress", [0.05] * (WARMUP + MIN_SAMPLES))
    assert pace.learned("progress") and pace.deadline("progress") == FLOOR  # 0.15 s -> the floor
    pace.add("section:eval", [40.0] * (WARMUP + MIN_SAMPLES))
    assert pace.deadline("section:eval") == 120.0
    assert pace.changed() == {"progress": FLOOR, "section:eval": 120.0}
    assert pace.changed() == {}  # unchanged: nothing new to report
    pace.add("section:eval", [90.0] * 30)
    assert pace.changed() == {"section:eval": 270.0}
    assert quantile([1.0] * 99 + [1e9], 0.99) == 1.0

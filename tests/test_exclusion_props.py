"""Exclusion windows and records (elastictk/agent/exclusion.py): hypothesis properties.

R failures within T seconds exclude, R-1 or failures spread wider than T do not; the answer is
a brute-force count's at every step; the cooldown ends exactly at start + seconds; a window
refuses a clock that goes backwards; any dict read from the store is a record or None, never
an exception.
"""
from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.agent.exclusion import (
    MAX_COOLDOWN, Cooldown, Exclusion, ExclusionSettings, FailureWindow, parse_after,
)

R = st.integers(1, 8)
T = st.floats(0.5, 1000, allow_nan=False)
GAPS = st.lists(st.floats(0, 500, allow_nan=False), min_size=1, max_size=40)


def times(start: float, gaps: list[float]) -> list[float]:
    out, at = [], start
    for g in gaps:
        at += g
        out.append(at)
    return out


@given(R, T, GAPS, st.floats(0, 1e6, allow_nan=False))
def test_the_window_answers_as_a_brute_force_count(r: int, t: float, gaps: list[float], start: float) -> None:
    w = FailureWindow(r, t)
    seen: list[float] = []
    for at in times(start, gaps):
        seen.append(at)
        assert w.add(at) == (sum(1 for x in seen if at - x <= t) >= r)


@given(R, T, st.floats(0, 0.999), st.floats(0, 1e6, allow_nan=False), st.data())
def test_r_failures_within_t_exclude(r: int, t: float, share: float, start: float, data: st.DataObject) -> None:
    offsets = sorted(data.draw(st.lists(st.floats(0, 1), min_size=r, max_size=r)))
    w = FailureWindow(r, t)
    answers = [w.add(start + t * share * o) for o in offsets]  # all R within T of the first
    assert answers[-1] is True
    assert not any(answers[:-1]), "excluded before the R-th failure"


@given(st.integers(2, 8), st.integers(1, 10**6), st.integers(0, 10**9))
def test_first_and_last_exactly_t_apart_still_exclude(r: int, t: int, start: int) -> None:
    w = FailureWindow(r, float(t))
    answers = [w.add(float(start)) for _ in range(r - 1)] + [w.add(float(start + t))]
    assert answers == [False] * (r - 1) + [True]
    assert not FailureWindow(r, float(t)).add(float(start)) or r == 1


@given(R, T, GAPS, st.floats(0, 1e6, allow_nan=False))
def test_r_minus_one_failures_never_exclude(r: int, t: float, gaps: list[float], start: float) -> None:
    w = FailureWindow(r, t)
    assert not any(w.add(at) for at in times(start, gaps[: r - 1]))


@given(st.integers(2, 8), T, st.lists(st.floats(1.001, 50), min_size=1, max_size=30),
       st.floats(0, 1e5, allow_nan=False))
def test_failures_spread_wider_than_t_never_exclude(r: int, t: float, factors: list[float], start: float) -> None:
    # Consecutive failures more than T/(R-1) apart: any R of them span more than T.
    w = FailureWindow(r, t)
    gap = t / (r - 1)
    assert not any(w.add(at) for at in times(start, [0.0] + [gap * f for f in factors]))


@given(R, T, st.floats(1, 1e6, allow_nan=False), st.floats(0.001, 1e3, allow_nan=False))
def test_a_window_refuses_a_clock_that_goes_back(r: int, t: float, at: float, back: float) -> None:
    w = FailureWindow(r, t)
    w.add(at)
    with pytest.raises(ValueError, match="monotonic"):
        w.add(at - back)


@given(st.floats(0, 1e7, allow_nan=False), st.floats(0.001, MAX_COOLDOWN, allow_nan=False))
def test_the_cooldown_ends_exactly_when_it_should(start: float, seconds: float) -> None:
    c = Cooldown(start, seconds)
    assert c.over(c.until) and c.left(c.until) == 0.0
    before = math.nextafter(c.until, -math.inf)
    assert not c.over(before) and c.left(before) > 0
    assert not c.over(start) and c.left(start) == pytest.approx(seconds)
    assert c.over(c.until + 1)


@given(st.text(min_size=1, max_size=20), st.sampled_from(["failures", "straggler", "health_check"]),
       st.text(max_size=500), st.floats(0.001, 1e9, allow_nan=False), st.text(max_size=20))
def test_a_record_reads_back_as_written_clamped(node: str, reason: str, detail: str, cooldown: float, by: str) -> None:
    ex = Exclusion(node, reason, detail, cooldown, by)
    back = Exclusion.from_json(node, ex.to_json())
    assert back is not None
    assert (back.node_id, back.reason, back.by) == (node, reason, by)
    assert back.detail == detail[:300] and back.cooldown_s == min(cooldown, MAX_COOLDOWN)
    assert Exclusion.from_json(node + "x", ex.to_json()) is None, "a record for another node excludes nobody"


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                    max_leaves=8)


@settings(max_examples=300)
@given(st.dictionaries(st.sampled_from(["node_id", "reason", "detail", "cooldown_s", "by", "x"]), JSON))
def test_any_dict_is_a_record_or_none(body: dict[str, Any]) -> None:
    got = Exclusion.from_json("n1", body)
    assert got is None or (got.node_id == "n1" and 0 < got.cooldown_s <= MAX_COOLDOWN)


@given(st.integers(1, 1000), st.integers(1, 86400))
def test_r_over_t_parses(r: int, t: int) -> None:
    assert parse_after(f"{r}/{t}") == (r, float(t))
    assert ExclusionSettings((r, float(t)), 1.0).on


@pytest.mark.parametrize("text", ["3", "0/60", "-1/60", "3/0", "3/-5", "3/nan", "3/inf", "x/60", "3/y", ""])
def test_bad_r_over_t_is_refused_in_words(text: str) -> None:
    with pytest.raises(ValueError, match="R|T"):
        parse_after(text)


@pytest.mark.parametrize("cooldown", [0, -1, math.inf, math.nan, MAX_COOLDOWN * 2, True])
def test_bad_cooldown_is_refused(cooldown: float) -> None:
    with pytest.raises(ValueError, match="seconds"):
        ExclusionSettings(None, cooldown)

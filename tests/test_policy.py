"""Restart policy: torchrun's budget, OTP's intensity and seeded backoff, as pure decisions."""
from __future__ import annotations

import json
import math
from typing import Optional

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from elastictk.agent.policy import (
    Backoff,
    Decision,
    Event,
    Failure,
    GiveUp,
    MaxRestarts,
    MembershipChange,
    PolicyState,
    Rerendezvous,
    Restart,
    RestartIntensity,
    RestartPolicy,
)

CAUSE = "rank 1's SIGSEGV (signal 11)"


# ---------------------------------------------------------------- strategies
@st.composite
def event_lists(draw: st.DrawFn, max_size: int = 40) -> list[Event]:
    """Events at non-decreasing times, failures and membership changes mixed."""
    kinds = draw(st.lists(st.sampled_from(["F", "M"]), max_size=max_size))
    gaps = draw(st.lists(st.floats(min_value=0, max_value=100, allow_nan=False),
                         min_size=len(kinds), max_size=len(kinds)))
    t, out = 0.0, []
    for kind, gap in zip(kinds, gaps):
        t += gap
        out.append(Failure(t, CAUSE) if kind == "F" else MembershipChange(t))
    return out


backoffs = st.builds(
    lambda initial, span, factor, jitter, seed: Backoff(initial=initial, factor=factor,
                                                        max=initial + span, jitter=jitter, seed=seed),
    st.just(0.0) | st.floats(min_value=1e-3, max_value=30),
    st.floats(min_value=0, max_value=300, allow_nan=False),
    st.floats(min_value=1, max_value=4, allow_nan=False),
    st.floats(min_value=0, max_value=1, allow_nan=False),
    st.integers(min_value=0, max_value=2**32) | st.text(max_size=8),
)

policies = st.builds(
    RestartPolicy,
    max_restarts=st.none() | st.integers(min_value=0, max_value=10),
    intensity=st.none() | st.tuples(st.integers(min_value=0, max_value=6),
                                    st.floats(min_value=0.5, max_value=500, allow_nan=False)),
    backoff=st.none() | backoffs,
)


def torchrun_oracle(n: int, events: list[Event]) -> list[tuple[str, int] | str]:
    """torch's ``SimpleElasticAgent._invoke_run`` transcribed: remaining_restarts starts at
    max_restarts; a failure restarts while remaining > 0 (decrementing first) else gives up;
    a waiting node restarts without touching it. Workers see max_restarts - remaining."""
    remaining = n
    out: list[tuple[str, int] | str] = []
    for ev in events:
        if isinstance(ev, Failure):
            if remaining > 0:
                remaining -= 1
                out.append(("restart", n - remaining))
            else:
                out.append("give up")
                break
        else:
            out.append(("rerendezvous", n - remaining))
    return out


def as_oracle(decisions: list[Decision]) -> list[tuple[str, int] | str]:
    out: list[tuple[str, int] | str] = []
    for d in decisions:
        if isinstance(d, Restart):
            out.append(("restart", d.restart_count))
        elif isinstance(d, Rerendezvous):
            out.append(("rerendezvous", d.restart_count))
        else:
            out.append("give up")
    return out


# ---------------------------------------------------------------- torchrun's budget
@given(st.integers(min_value=0, max_value=8), event_lists())
@settings(max_examples=300)
def test_max_restarts_matches_torchrun(n: int, events: list[Event]) -> None:
    _, decisions = RestartPolicy(max_restarts=n).run(events)
    assert as_oracle(decisions) == torchrun_oracle(n, events)


@given(policies, event_lists())
@settings(max_examples=300)
def test_restart_count_never_exceeds_the_budget(policy: RestartPolicy, events: list[Event]) -> None:
    state, decisions = policy.run(events)
    counts = [d.restart_count for d in decisions if isinstance(d, (Restart, Rerendezvous))]
    assert counts == sorted(counts)
    if isinstance(policy.max_restarts, MaxRestarts):
        assert all(c <= policy.max_restarts.n for c in counts)
    restarts = [d for d in decisions if isinstance(d, Restart)]
    assert [r.restart_count for r in restarts] == list(range(1, len(restarts) + 1))
    assert all(d.delay_s >= 0 for d in restarts)
    assert json.loads(json.dumps(state.to_json())) == state.to_json()


@given(st.integers(min_value=0, max_value=6), event_lists(), st.data())
@settings(max_examples=200)
def test_membership_changes_never_consume_budget(n: int, events: list[Event],
                                                 data: st.DataObject) -> None:
    """Removing every membership change leaves the failure decisions exactly as they were."""
    policy = RestartPolicy(max_restarts=n, intensity=data.draw(
        st.none() | st.tuples(st.integers(0, 5), st.floats(1, 300))))
    _, mixed = policy.run(events)
    only_failures = [e for e in events if isinstance(e, Failure)]
    _, pure = policy.run(only_failures)
    assert [d for d in mixed if not isinstance(d, Rerendezvous)] == pure
    last = 0
    for d in mixed:
        if isinstance(d, Rerendezvous):
            assert d.restart_count == last and d.delay_s == 0
        elif isinstance(d, Restart):
            last = d.restart_count


def test_torchrun_example_and_give_up_line() -> None:
    policy = RestartPolicy(max_restarts=2)
    state, ds = policy.run([Failure(1.0, CAUSE), MembershipChange(2.0), Failure(3.0, CAUSE),
                            Failure(4.0, CAUSE), Failure(5.0, CAUSE)])
    assert ds == [Restart(0.0, 1), Rerendezvous(1), Restart(0.0, 2), GiveUp(
        "restart budget spent: 3 failures > --max-restarts=2; "
        "raise --max-restarts or fix rank 1's SIGSEGV (signal 11)")]
    assert state.gave_up is not None and state.failures == 3
    # Final: whatever comes next, the answer stays.
    assert policy.decide(state, MembershipChange(9.0)) == (state, GiveUp(state.gave_up))
    zero = RestartPolicy(max_restarts=0).run([Failure(0.0)])[1]
    assert zero == [GiveUp("restart budget spent: 1 failures > --max-restarts=0; raise "
                           "--max-restarts or fix the failing worker (see the failure report)")]


# ---------------------------------------------------------------- OTP intensity
def first_crowded(times: list[float], r: int, period: float) -> Optional[int]:
    """Brute force: the first failure index at which some closed window of length ``period``
    (anywhere, not only ending at a failure) holds more than ``r`` failures seen so far."""
    for i in range(len(times)):
        seen = times[: i + 1]
        for start in seen:  # a crowded window can always be slid to start at a failure
            if sum(1 for x in seen if start <= x <= start + period) > r:
                return i
    return None


@given(st.integers(min_value=0, max_value=5), st.integers(min_value=1, max_value=200),
       st.lists(st.integers(min_value=0, max_value=80), max_size=30))
@settings(max_examples=400)
def test_intensity_gives_up_iff_a_window_is_crowded(r: int, period_q: int, gaps_q: list[int]) -> None:
    # Quarter seconds: exact in binary floating point, so window edges are compared exactly
    # (the policy computes ``t - period``, the oracle ``start + period``).
    period = period_q / 4
    times = [sum(gaps_q[: i + 1]) / 4 for i in range(len(gaps_q))]
    policy = RestartPolicy(max_restarts=None, intensity=(r, period))
    _, ds = policy.run([Failure(t) for t in times])
    expected = first_crowded(times, r, period)
    if expected is None:
        assert len(ds) == len(times) and all(isinstance(d, Restart) for d in ds)
    else:
        assert len(ds) == expected + 1 and isinstance(ds[-1], GiveUp)
        assert all(isinstance(d, Restart) for d in ds[:-1])
        assert ds[-1].reason.startswith(f"restarting too often: {r + 1} failures within")


def test_intensity_window_is_closed_as_in_otp() -> None:
    policy = RestartPolicy(max_restarts=None, intensity=(2, 10.0))
    # Three failures exactly 10s apart end-to-end: [0, 10] holds 3 > 2.
    _, ds = policy.run([Failure(0.0), Failure(5.0), Failure(10.0, CAUSE)])
    assert isinstance(ds[-1], GiveUp)
    assert ds[-1].reason == ("restarting too often: 3 failures within 10s > 2 allowed (restart "
                             "intensity 2 per 10s); raise the intensity limit or fix " + CAUSE)
    _, ds = policy.run([Failure(0.0), Failure(5.0), Failure(10.001)])
    assert all(isinstance(d, Restart) for d in ds)


def test_intensity_state_stays_bounded() -> None:
    policy = RestartPolicy(max_restarts=None, intensity=(3, 10.0))
    state, ds = policy.run([Failure(20.0 * i) for i in range(500)])
    assert len(ds) == 500 and state.failures == 500 and state.failure_times == (9980.0,)


def test_budget_is_reported_before_intensity() -> None:
    _, ds = RestartPolicy(max_restarts=1, intensity=(1, 60)).run([Failure(0.0), Failure(1.0)])
    assert isinstance(ds[-1], GiveUp) and ds[-1].reason.startswith("restart budget spent")


# ---------------------------------------------------------------- backoff
@given(backoffs, st.integers(min_value=1, max_value=60))
@settings(max_examples=300)
def test_backoff_monotone_bounded_reproducible(b: Backoff, steps: int) -> None:
    delays = [b.delay(k) for k in range(1, steps + 1)]
    assert delays == sorted(delays)
    assert all(0 <= d <= b.max for d in delays)
    for k, d in enumerate(delays, start=1):  # between the plain exponential and its stretch
        base = b.initial * b.factor ** (k - 1)
        assert d >= min(b.max, base) * (1 - 1e-9)
        assert d <= min(b.max, base * (1 + b.jitter)) * (1 + 1e-9)
    twin = Backoff(initial=b.initial, factor=b.factor, max=b.max, jitter=b.jitter, seed=b.seed)
    assert [twin.delay(k) for k in range(1, steps + 1)] == delays


def test_backoff_jitter_differs_between_seeds_and_exact_without_jitter() -> None:
    plain = Backoff(initial=1, factor=2, max=10)
    assert [plain.delay(k) for k in range(0, 7)] == [0.0, 1, 2, 4, 8, 10, 10]
    a = [Backoff(initial=1, factor=2, max=100, jitter=0.5, seed=1).delay(k) for k in range(1, 5)]
    b = [Backoff(initial=1, factor=2, max=100, jitter=0.5, seed=2).delay(k) for k in range(1, 5)]
    assert a != b and all(1 <= x <= 1.5 for x in a[:1])


def test_policy_applies_backoff_and_resets_after_a_healthy_run() -> None:
    policy = RestartPolicy(max_restarts=None,
                           backoff=Backoff(initial=1, factor=2, max=30, reset_after=100))
    _, ds = policy.run([Failure(0.0), Failure(5.0), MembershipChange(20.0), Failure(21.0),
                        Failure(500.0), Failure(501.0)])
    delays = [d.delay_s for d in ds if isinstance(d, Restart)]
    assert delays == [1, 2, 4, 1, 2]  # the attempt started at 25 ran 475s > 100s: start over


# ---------------------------------------------------------------- state as JSON
@given(policies, event_lists(), event_lists(max_size=8))
@settings(max_examples=200)
def test_state_json_round_trip_continues_identically(policy: RestartPolicy, events: list[Event],
                                                     more: list[Event]) -> None:
    state, _ = policy.run(events)
    wire = json.dumps(state.to_json())
    again = PolicyState.from_json(json.loads(wire))
    assert again == state
    shift = state.last_t or 0.0
    later = [type(e)(e.t + shift, e.cause) for e in more]
    assert policy.run(later, again) == policy.run(later, state)


@pytest.mark.parametrize("bad,why", [
    ([], "schema"),
    ({"schema": "x"}, "schema"),
    ({"schema": "elastictk.restart-policy/1", "failures": -1}, "'failures' must be an int >= 0"),
    ({"schema": "elastictk.restart-policy/1", "failures": True}, "'failures' must be an int >= 0"),
    ({"schema": "elastictk.restart-policy/1", "failure_times": "1"}, "must be a list"),
    ({"schema": "elastictk.restart-policy/1", "failure_times": [None]}, "finite number"),
    ({"schema": "elastictk.restart-policy/1", "last_t": "soon"}, "'last_t' must be a finite"),
    ({"schema": "elastictk.restart-policy/1", "gave_up": 3}, "'gave_up' must be text"),
])
def test_bad_state_is_one_clear_line(bad: object, why: str) -> None:
    with pytest.raises(ValueError, match=why) as ei:
        PolicyState.from_json(bad)
    assert "\n" not in str(ei.value)


# ---------------------------------------------------------------- config and time edge cases
@pytest.mark.parametrize("make,why", [
    (lambda: MaxRestarts(-1), "--max-restarts must be a whole number >= 0"),
    (lambda: RestartPolicy(max_restarts=1.5), "--max-restarts"),  # type: ignore[arg-type]
    (lambda: RestartIntensity(1, 0), "period must be seconds > 0"),
    (lambda: RestartIntensity(-1, 5), "max_restarts must be a whole number"),
    (lambda: RestartPolicy(intensity=(1, 2, 3)), "must be (max_restarts, period_s)"),  # type: ignore[arg-type]
    (lambda: Backoff(factor=0.5), "factor must be a finite number >= 1"),
    (lambda: Backoff(initial=5, max=1), "max (1s) must be >= initial (5s)"),
    (lambda: Backoff(jitter=2), "jitter is a fraction"),
    (lambda: Backoff(reset_after=0), "reset_after must be seconds > 0"),
    (lambda: RestartPolicy(backoff=3), "backoff must be a Backoff"),  # type: ignore[arg-type]
])
def test_bad_config_is_one_clear_line(make: object, why: str) -> None:
    with pytest.raises(ValueError) as ei:
        make()  # type: ignore[operator]
    assert why in str(ei.value) and "\n" not in str(ei.value)


def test_non_finite_time_is_refused_and_a_clock_stepping_back_is_clamped() -> None:
    policy = RestartPolicy(max_restarts=None, intensity=(1, 10.0))
    with pytest.raises(ValueError, match="event time must be a finite number"):
        policy.decide(policy.initial_state(), Failure(math.nan))
    state, d1 = policy.decide(policy.initial_state(), Failure(100.0))
    state, d2 = policy.decide(state, Failure(50.0))  # treated as t=100: same window
    assert isinstance(d1, Restart) and isinstance(d2, GiveUp) and state.last_t == 100.0


def test_describe() -> None:
    p = RestartPolicy(max_restarts=3, intensity=(5, 60), backoff=Backoff(1, 2, 60, jitter=0.1))
    assert p.describe() == "max 3 restarts; at most 5 per 60s; backoff 1s x2 up to 60s, jitter 0.1"
    assert RestartPolicy(max_restarts=None).describe() == "no restart budget; restart at once"


@given(st.integers(min_value=0, max_value=5), st.integers(min_value=0, max_value=30))
def test_give_up_iff_more_failures_than_budget(n: int, k: int) -> None:
    _, ds = RestartPolicy(max_restarts=n).run([Failure(float(i)) for i in range(k)])
    assert isinstance(ds[-1], GiveUp) if k > n else (len(ds) == k and not any(
        isinstance(d, GiveUp) for d in ds))
    assume(k > n)
    assert len(ds) == n + 1

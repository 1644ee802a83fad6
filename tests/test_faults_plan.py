"""Fault plans: the same seed gives the same plan, JSON round-trips, knobs hold, garbage is refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.faults import Fault, FaultPlan, PlanError, generate_plan, plan_of

CRASHES = ["sigkill", "sigterm", "sigsegv", "exception", "exit:3"]

knobs = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31),
    "count": st.integers(0, 4),
    "world": st.integers(1, 8),
    "kinds": st.lists(st.sampled_from(CRASHES + ["slow:1.5", "hang"]), min_size=1, max_size=4, unique=True),
    "lo": st.integers(1, 20),
    "gap": st.integers(1, 3),
})


@settings(max_examples=80, deadline=None)
@given(knobs)
def test_generated_plans_are_deterministic_round_trip_and_respect_the_knobs(k: dict) -> None:
    never = [0] if k["world"] > 1 else []
    hi = k["lo"] + 4 * k["gap"] + 10
    make = lambda: generate_plan(k["seed"], k["count"], k["world"], kinds=k["kinds"],  # noqa: E731
                                 steps=(k["lo"], hi), never=never, min_gap_steps=k["gap"],
                                 watchdog_s=30)
    plan = make()
    assert plan == make(), "same seed and knobs, same plan"
    assert FaultPlan.from_json(json.loads(plan.dumps())) == plan
    assert len(plan) == k["count"]
    steps = sorted(f.at_step for f in plan)  # type: ignore[type-var]
    assert all(k["lo"] <= s < hi for s in steps)
    assert all(b - a >= k["gap"] for a, b in zip(steps, steps[1:]))
    allowed = {x.split(":")[0] for x in k["kinds"]}
    for f in plan:
        assert f.kind in allowed
        assert f.target.kind == "rank" and f.target.index not in never and f.target.index < k["world"]
    # Attempts count the restarts of earlier step faults: each fault fires in its own attempt.
    attempts = [f.attempt for f in sorted(plan, key=lambda f: f.at_step)]  # type: ignore[arg-type, return-value]
    assert attempts == sorted(attempts)
    assert plan.expected_restarts() == sum(1 for f in plan if plan.needs_restart(f))


def test_a_different_seed_gives_a_different_plan() -> None:
    plans = {generate_plan(s, 3, 4, steps=(1, 40)).dumps() for s in range(5)}
    assert len(plans) > 1


def test_hand_written_plan_save_load(tmp_path: Path) -> None:
    plan = plan_of([Fault.of("exit:7", "rank:1", at_step=4), Fault.of("hang", "rank:0", at_s=2.5)],
                   watchdog_s=10)
    path = plan.save(tmp_path / "plan.json")
    again = FaultPlan.load(path)
    assert again == plan
    assert [f.attempt for f in again] == [0, None]
    assert plan.expected_restarts() == 2  # the hang is caught by the 10 s watchdog


@pytest.mark.parametrize("doc, message", [
    ({"schema": "elastictk.fault-plan/1", "faults": [{"kind": "explode", "target": "rank:0", "at_step": 1}]},
     "unknown fault kind 'explode'"),
    ({"schema": "elastictk.fault-plan/1", "faults": [{"kind": "sigkill", "target": "rank:x", "at_step": 1}]},
     "'x' is not a number"),
    ({"schema": "elastictk.fault-plan/1", "faults": [{"kind": "exception", "target": "rank:0", "at_s": 3}]},
     "write at_step instead of at_s"),
    ({"schema": "other/9", "faults": []}, "schema 'other/9' is not supported"),
    ({"schema": "elastictk.fault-plan/1", "faults": [{"kind": "sigkill", "target": "rank:0", "when": 1}]},
     "unknown field 'when'"),
])
def test_bad_plans_name_the_problem_in_one_line(tmp_path: Path, doc: dict, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError) as e:
        FaultPlan.load(path)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(path) in str(e.value)


def test_unreadable_and_non_json_plans(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="cannot read the fault plan"):
        FaultPlan.load(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        FaultPlan.load(tmp_path / "x.json")


def test_knobs_that_cannot_be_met_are_refused() -> None:
    with pytest.raises(PlanError, match="every rank"):
        generate_plan(1, 2, 2, steps=(1, 10), never=[0, 1])
    with pytest.raises(PlanError):
        generate_plan(1, 10, 2, steps=(1, 5), min_gap_steps=3)

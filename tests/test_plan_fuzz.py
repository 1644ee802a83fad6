"""The fault-plan reader (``FaultPlan.load``, what ``--plan`` and the workers read) against
garbage: nested, huge, truncated, invalid UTF-8, NaN/Infinity, wrong types. Whatever the bytes,
it returns a plan or raises :class:`PlanError` with one line naming the file; nothing else
escapes (no RecursionError, TypeError, UnicodeDecodeError...)."""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastictk.faults import FaultPlan, PlanError
from elastictk.faults.plan import MAX_PLAN_BYTES, SCHEMA

GOOD = {"schema": SCHEMA, "watchdog_s": 30, "seed": 7, "faults": [
    {"at_step": 20, "target": "rank:1", "kind": "sigsegv", "attempt": 0},
    {"at_s": 12.5, "target": "node:0", "kind": "kill-agent"},
    {"at_step": 3, "target": "rank:0", "kind": "slow:2.5"},
]}
GOOD_BYTES = json.dumps(GOOD).encode()

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _load(data: bytes) -> FaultPlan | None:
    """Load ``data`` as a plan file; None when refused with a proper one-line PlanError."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "plan.json"
        path.write_bytes(data)
        try:
            plan = FaultPlan.load(path)
        except PlanError as e:
            msg = str(e)
            assert "\n" not in msg and "\r" not in msg, msg[:300]
            assert msg.startswith(str(path)), msg[:300]
            return None
    assert isinstance(plan, FaultPlan)
    for f in plan.faults:
        assert f.at_s is None or math.isfinite(f.at_s)
    return plan


# Any JSON value, NaN and the infinities included (json.dumps writes them as NaN/Infinity).
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=20)

field_values = st.one_of(
    json_values, st.sampled_from(["rank:1", "node:0", "store", "rank:-1", "rank:x", "sigkill",
                                  "slow:2", "slow:nan", "exit:0", "exit:300", "kill-agent",
                                  "store-outage:1", "hang", "", " ", "rank:" + "9" * 5000]),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0, 10**400]))

faults = st.dictionaries(st.sampled_from(["at_s", "at_step", "target", "kind", "attempt", "other"]),
                         field_values, max_size=6)
knobs = st.dictionaries(st.sampled_from(["count", "world_size", "steps", "seconds", "kinds", "never",
                                         "nodes", "min_gap_s", "watchdog_s", "slow_s", "x"]),
                        field_values, max_size=5)
plans = st.fixed_dictionaries(
    {"schema": st.sampled_from([SCHEMA, SCHEMA, "elastictk.fault-plan/2", 1, None])},
    optional={"faults": st.lists(faults, max_size=4) | field_values,
              "watchdog_s": field_values, "seed": field_values, "knobs": knobs | field_values,
              "extra": field_values})


def _dump(value: Any) -> bytes:
    try:
        return json.dumps(value).encode()
    except ValueError:  # an integer past the digit limit: write it out by hand
        return repr(value).encode()


@FUZZ
@given(plans)
def test_plan_shaped_documents_load_or_fail_in_one_line(doc: dict) -> None:
    _load(_dump(doc))


@FUZZ
@given(json_values)
def test_any_json_value_loads_or_fails_in_one_line(value: Any) -> None:
    _load(_dump(value))


@FUZZ
@given(st.binary(max_size=2000))
def test_random_bytes_fail_in_one_line(data: bytes) -> None:
    _load(data)


@FUZZ
@given(st.integers(min_value=0, max_value=len(GOOD_BYTES)))
def test_a_truncated_plan_fails_in_one_line(cut: int) -> None:
    plan = _load(GOOD_BYTES[:cut])
    assert (plan is not None) == (cut == len(GOOD_BYTES))


@FUZZ
@given(st.integers(min_value=0, max_value=len(GOOD_BYTES) - 1), st.binary(min_size=1, max_size=4))
def test_invalid_utf8_in_a_plan_fails_in_one_line(at: int, junk: bytes) -> None:
    data = GOOD_BYTES[:at] + b"\xff" + junk + GOOD_BYTES[at:]
    _load(data)


@pytest.mark.parametrize("depth", [100, 1000, 100_000])
@pytest.mark.parametrize("opener", [b"[", b'{"a":'])
def test_deeply_nested_plans_fail_in_one_line(depth: int, opener: bytes) -> None:
    assert _load(opener * depth) is None
    assert _load(b'{"schema": "%s", "faults": [' % SCHEMA.encode() + opener * depth) is None


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_are_refused_naming_them(tmp_path: Path, constant: bytes) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(b'{"schema": "%s", "watchdog_s": %s, "faults": []}' % (SCHEMA.encode(), constant))
    with pytest.raises(PlanError) as e:
        FaultPlan.load(path)
    assert constant.decode() in str(e.value) and "\n" not in str(e.value)


def test_a_huge_plan_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    with open(path, "wb") as f:
        f.write(GOOD_BYTES[:-2])
        f.write(b" " * MAX_PLAN_BYTES)
        f.write(b"]}")
    with pytest.raises(PlanError) as e:
        FaultPlan.load(path)
    assert "larger than" in str(e.value) and "\n" not in str(e.value)


def test_the_good_plan_loads() -> None:
    """The passing side of the fuzzers: the seed document is a plan."""
    plan = _load(GOOD_BYTES)
    assert plan is not None and len(plan) == 3 and plan.watchdog_s == 30

"""``elastictk.faults.checkpoint`` became ``fault_point`` (it read as ``elastictk.metrics.checkpoint``,
which does something else); the old name warns, names the new one and still performs the plan."""
from __future__ import annotations

import warnings

import pytest

import elastictk.faults as faults
from elastictk.faults import inworker


def test_the_old_name_warns_and_forwards(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    monkeypatch.setattr(inworker, "fault_point", seen.append)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        faults.checkpoint(7)
    assert seen == [7]
    (w,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert "elastictk.faults.fault_point" in str(w.message)


def test_the_new_name_is_public_and_quiet() -> None:
    assert "fault_point" in faults.__all__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        faults.fault_point(0)  # no plan in this process: a no-op

"""``State.restore()`` with no snapshot tier restores nothing: a restarted worker says so, once."""
from __future__ import annotations

import logging

import pytest

from elastictk.inplace import state as state_mod
from elastictk.inplace.state import State

TIER_ENV = ("ELASTICTK_SNAPSHOT", "ELASTICTK_SNAPSHOT_DIR", "ELASTICTK_SNAPSHOT_EVERY", "ELASTICTK_SNAPSHOT_OVERLAP")


@pytest.fixture(autouse=True)
def _no_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TIER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(state_mod, "_warned_no_tier", False, raising=False)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "elastictk.inplace" and r.levelno == logging.WARNING]


def test_a_restarted_worker_without_a_tier_is_told_once_that_nothing_was_restored(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    caplog.set_level(logging.WARNING, logger="elastictk.inplace")
    s = State(step=0)
    assert s.restore() is None
    assert s.restore() is None
    (line,) = _warnings(caplog)
    assert "restart 2" in line and "no snapshot tier" in line and "--snapshot" in line
    assert "\n" not in line


@pytest.mark.parametrize("count", [None, "", "0"])
def test_a_first_start_without_a_tier_says_nothing(count: str | None, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    if count is None:
        monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", count)
    caplog.set_level(logging.WARNING, logger="elastictk.inplace")
    assert State(step=0).restore() is None
    assert _warnings(caplog) == []


def test_a_garbled_restart_count_is_no_error(monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "x\udcff")
    assert State(step=0).restore() is None

"""elastictk-chaos with the learned hang judge: hang kinds need no hang-related flag (the plan's
watchdog is the learned deadlines' floor), and the report gives each hang's detection time
beside the deadline it was judged against. The soak itself (real runs) is ``python -m bench
hang`` and the commit messages; here the decisions."""
from __future__ import annotations

from pathlib import Path

from elastictk.agent.pace import FLOOR
from elastictk.chaos.jobplan import hang_watchdog
from elastictk.chaos.checks import _hangs_caught
from elastictk.chaos.rows import FaultRow
from elastictk.chaos.record import RunRecord
from elastictk.cli import parse_args
from elastictk.metrics.events import Event

TRAIN = str(Path(__file__).resolve().parent.parent / "examples" / "train.py")


def test_the_plans_watchdog_under_each_hang_detection_mode() -> None:
    def of(*flags: str) -> object:
        return hang_watchdog(parse_args([*flags, "--standalone", TRAIN]))

    assert of() == FLOOR  # the default: learned, no flag needed for hang kinds
    assert of("--collective-timeout", "3") == 3.0
    assert of("--progress-timeout", "2") == 2.0  # a ceiling under the floor is the deadline
    assert of("--hang-detection", "fixed", "--progress-timeout", "0") is None
    assert of("--hang-detection", "off") is None  # nothing would end a hang: refused by the plan


def test_the_hang_check_gives_the_detection_time_and_the_learned_deadline() -> None:
    row = FaultRow(0, "hang", "rank:1", "step 30", True, True, injected_at=2.0)
    rec = RunRecord(argv=[], started=100.0)
    rec.events = [Event("hang_detected", {"rank": 1, "culprits": [1], "blocked": [0], "trigger": "learned",
                                          "timeout_s": 5.0}, mono=107.1)]
    check = _hangs_caught([row], rec, several_nodes=False)
    assert check.ok and check.detail == "all caught: #0 in 5.1s (learned deadline 5.0s)", check
    rec.events = []
    assert not _hangs_caught([row], rec, several_nodes=False).ok

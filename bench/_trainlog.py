"""What ``examples/train.py`` and ``elastictk-run`` print that the launch benchmarks time: a
rank's step and resume lines, the final checksum and the agent's ``pids=`` list. One copy for
the recovery and propagation jobs, which read the same job's output."""
from __future__ import annotations

import re

WORKER = re.compile(
    r"\[rank (?P<rank>\d+)\] (?:step (?P<step>\d+) loss"
    r"|resumed at step (?P<resumed>\d+) \(attempt (?P<attempt>\d+)\))"
)
FINAL = re.compile(r"final checksum (\w+) after (\d+) steps")
PIDS = re.compile(r"(\d+): (\d+)")

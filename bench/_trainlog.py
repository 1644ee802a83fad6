"""What ``examples/train.py`` and ``elastictk-run`` print that the launch benchmarks time: a
rank's step and resume lines, the final checksum, elastictk's agent events and their ``pids=``
list, torchrun's line for a failed worker. One copy for the recovery and propagation jobs, which
read the same job's output."""
from __future__ import annotations

import re

WORKER = re.compile(
    r"\[rank (?P<rank>\d+)\] (?:step (?P<step>\d+) loss"
    r"|resumed at step (?P<resumed>\d+) \(attempt (?P<attempt>\d+)\))"
)
FINAL = re.compile(r"final checksum (\w+) after (\d+) steps")
PIDS = re.compile(r"(\d+): (\d+)")
AGENT_EVENT = re.compile(r"\[elastictk-run\] (\w+)(.*)")  # an event and the rest of its line
TORCH_WORKER_FAILED = (re.compile(r"failed \(exitcode: "), "torch_worker_failed")

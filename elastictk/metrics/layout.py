"""The byte layout of the steps block: one shared page the agent owns and each worker writes.

Both sides agree on it without exchanging anything but a path: a header of ``HEADER_WORDS``
64-bit words, then one slot of ``SLOT_WORDS`` words per local rank. A slot has exactly one
writer at a time (the worker process of that local rank), so a write needs no lock; a
sequence word (odd while a write is in progress, a *seqlock*) lets the agent take a consistent
snapshot without ever blocking the worker. Slots are 512 bytes apart, so two workers never
write the same cache line.

Counts are unsigned words, durations are doubles; the two are views of the same memory.
Everything in a slot is cumulative over every process that ever ran in that local rank,
except the ``PROC_*``/``CKPT_*`` words, which describe the process running (or last run) there.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Any

MAGIC = 0x6574_6B5F_7374_6570  # "etk_step"
VERSION = 4  # 2: the straggler words (BLOCKED_SECONDS, BUSY_STEPS, BUSY_SECONDS); 3: FIRST/SECOND_STEP_MONO;
# 4: the progress words (PROGRESS_MONO ... GAP0), elastictk/metrics/marks.py
WORD = 8
HEADER_WORDS = 16
SLOT_WORDS = 64

# header words
H_MAGIC, H_VERSION, H_SLOTS, H_EPOCH, H_BUCKETS = 0, 1, 2, 3, 4

# slot words (offsets inside a slot); D marks a double
SEQ = 0  # seqlock: odd while the writer is mid-update
OWNER = 1  # PID of the process that last attached (0: never used)
EPOCH = 2  # the header's epoch when that process attached
STEPS = 3  # steps, every process
TIMED = 4  # steps with a known duration, every process
SECONDS = 5  # D: summed step duration, every process
PROC_STEPS = 6  # steps of the attached process
PROC_SECONDS = 7  # D: step time of the attached process
CKPT_STEPS = 8  # PROC_STEPS when that process last reported a checkpoint
CKPT_SECONDS = 9  # D: PROC_SECONDS at that checkpoint
LOST_STEPS = 10  # steps of earlier processes that no checkpoint covered
LOST_SECONDS = 11  # D: their step time
CHECKPOINTS = 12  # checkpoints reported, every process
LAST_STEP_WALL = 13  # D: wall-clock time of the latest step (for "no progress" alerts)
LAST_STEP_MONO = 14  # D: CLOCK_MONOTONIC of the latest step (the agent's progress watchdog)
# D: CLOCK_MONOTONIC of the attached process's first and second counted step (0: not yet), so
# the agent can time a recovery's restore and first step however late it reads the slot
FIRST_STEP_MONO = 15
BUCKET0 = 16  # BUCKETS words: per-bucket (not cumulative) counts of timed steps
# The straggler signal (elastictk/agent/stragglers.py), every process: time blocked inside
# Python collectives, and each timed step's own time (its duration less the time it was blocked).
BLOCKED_SECONDS = 33  # D: seconds inside torch.distributed calls made from Python
BUSY_STEPS = 34  # timed steps that added to BUSY_SECONDS
BUSY_SECONDS = 35  # D: their duration less the time blocked in collectives during them
SECOND_STEP_MONO = 36  # D: see FIRST_STEP_MONO
# Progress of any kind (elastictk/metrics/marks.py): a step, a completed collective, a
# fault_point, a section's start or end. Each word is one aligned store, written without the
# seqlock (a collective may end on another thread than the steps); the agent's hang judge
# (elastictk/agent/hangjudge.py) needs no two of them to agree.
PROGRESS_MONO = 37  # D: CLOCK_MONOTONIC of the latest progress mark
PROGRESS_COUNT = 38  # progress marks, every process
COLL_SINCE = 39  # D: when the collective this rank is inside began (0: in none)
COLLECTIVES = 40  # collectives completed, every process
SECTION_SINCE = 41  # D: when the user section this rank is inside began (0: in none)
SECTION_NAME = 42  # 2 words: its name's first 16 UTF-8 bytes
SECTIONS_DONE = 44  # sections completed, every process
SECTION_LAST_S = 45  # D: the latest completed section's duration
SECTION_LAST_NAME = 46  # 2 words: its name
GAP0 = 48  # GAPS words: histogram of the gaps between progress marks (after warm-up)
GAP_BOUNDS: tuple[float, ...] = tuple(0.0125 * 2 ** i for i in range(14))  # 12.5 ms .. 102.4 s
GAPS = len(GAP_BOUNDS) + 1

DOUBLES = frozenset({SECONDS, PROC_SECONDS, CKPT_SECONDS, LOST_SECONDS, LAST_STEP_WALL, LAST_STEP_MONO,
                     BLOCKED_SECONDS, BUSY_SECONDS, FIRST_STEP_MONO, SECOND_STEP_MONO,
                     PROGRESS_MONO, COLL_SINCE, SECTION_SINCE, SECTION_LAST_S})

# Upper bounds (seconds) of the step-duration histogram; the last bucket is +Inf.
STEP_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
)
BUCKETS = len(STEP_BUCKETS) + 1
assert BUCKET0 + BUCKETS <= BLOCKED_SECONDS and SECOND_STEP_MONO < PROGRESS_MONO
assert GAP0 + GAPS <= SLOT_WORDS


def block_size(slots: int) -> int:
    return (HEADER_WORDS + slots * SLOT_WORDS) * WORD


def slot_base(slot: int) -> int:
    """Word index of ``slot``'s first word."""
    return HEADER_WORDS + slot * SLOT_WORDS


def bucket_index(seconds: float) -> int:
    """The histogram bucket a duration falls in (Prometheus buckets are ``le``: inclusive)."""
    return bisect.bisect_left(STEP_BUCKETS, seconds)


@dataclass(frozen=True)
class SlotSnapshot:
    """A consistent copy of one slot, as the agent reads it on a scrape."""

    local_rank: int
    owner: int = 0
    epoch: int = 0
    steps: int = 0
    timed_steps: int = 0
    seconds: float = 0.0
    proc_steps: int = 0
    proc_seconds: float = 0.0
    ckpt_steps: int = 0
    ckpt_seconds: float = 0.0
    lost_steps: int = 0
    lost_seconds: float = 0.0
    checkpoints: int = 0
    last_step_wall: float = 0.0
    last_step_mono: float = 0.0  # time.monotonic() of the latest step: one clock per host
    buckets: tuple[int, ...] = (0,) * BUCKETS
    blocked_seconds: float = 0.0
    busy_steps: int = 0
    busy_seconds: float = 0.0
    first_step_mono: float = 0.0  # the attached process's first counted step (0: none yet)
    second_step_mono: float = 0.0  # and its second: the first whole step it timed
    progress_mono: float = 0.0  # the latest progress mark of any kind (0: none yet)
    progress_count: int = 0
    coll_since: float = 0.0  # inside a collective since (0: not in one)
    collectives: int = 0
    section_since: float = 0.0  # inside a user section since (0: not in one)
    section: str = ""
    sections_done: int = 0
    section_last_s: float = 0.0
    section_last: str = ""
    gaps: tuple[int, ...] = (0,) * GAPS

    @property
    def used(self) -> bool:
        return self.owner != 0

    def pending(self) -> tuple[int, float]:
        """Steps (and their time) of the attached process that no checkpoint covers yet."""
        return (max(0, self.proc_steps - self.ckpt_steps),
                max(0.0, self.proc_seconds - self.ckpt_seconds))


def read_slot(q: memoryview[int], d: memoryview[float], slot: int, *, patience: float = 0.05) -> SlotSnapshot:
    """Copy ``slot`` under its seqlock; never blocks the writer.

    A writer holds the lock for a few microseconds, so a retry nearly always succeeds. A writer
    killed mid-update leaves the word odd for good: after ``patience`` seconds the last copy is
    returned as it is (a few words off by one step is harmless for metrics).
    """
    base = slot_base(slot)
    deadline = None
    while True:
        before = q[base + SEQ]
        words: list[Any] = [d[base + i] if i in DOUBLES else q[base + i] for i in range(GAP0 + GAPS)]
        if before % 2 == 0 and q[base + SEQ] == before:
            break
        now = time.monotonic()
        if deadline is None:
            deadline = now + patience
        elif now >= deadline:
            break
        time.sleep(0)  # let a descheduled writer finish
    return SlotSnapshot(
        local_rank=slot, owner=words[OWNER], epoch=words[EPOCH], steps=words[STEPS],
        timed_steps=words[TIMED], seconds=words[SECONDS], proc_steps=words[PROC_STEPS],
        proc_seconds=words[PROC_SECONDS], ckpt_steps=words[CKPT_STEPS],
        ckpt_seconds=words[CKPT_SECONDS], lost_steps=words[LOST_STEPS],
        lost_seconds=words[LOST_SECONDS], checkpoints=words[CHECKPOINTS],
        last_step_wall=words[LAST_STEP_WALL], last_step_mono=words[LAST_STEP_MONO],
        buckets=tuple(int(w) for w in words[BUCKET0:BUCKET0 + BUCKETS]),
        blocked_seconds=words[BLOCKED_SECONDS], busy_steps=words[BUSY_STEPS],
        busy_seconds=words[BUSY_SECONDS], first_step_mono=words[FIRST_STEP_MONO],
        second_step_mono=words[SECOND_STEP_MONO], progress_mono=words[PROGRESS_MONO],
        progress_count=words[PROGRESS_COUNT], coll_since=words[COLL_SINCE],
        collectives=words[COLLECTIVES], section_since=words[SECTION_SINCE],
        section=name_of(words[SECTION_NAME], words[SECTION_NAME + 1]),
        sections_done=words[SECTIONS_DONE], section_last_s=words[SECTION_LAST_S],
        section_last=name_of(words[SECTION_LAST_NAME], words[SECTION_LAST_NAME + 1]),
        gaps=tuple(int(w) for w in words[GAP0:GAP0 + GAPS]),
    )


def name_words(name: str) -> tuple[int, int]:
    """A section name's first 16 UTF-8 bytes as two words (cut on a character boundary)."""
    raw = name.encode("utf-8", "replace")[:16].decode("utf-8", "ignore").encode("utf-8").ljust(16, b"\0")
    return int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")


def name_of(w0: int, w1: int) -> str:
    """What :func:`name_words` wrote (any bytes: a torn or foreign word reads as some text)."""
    raw = int(w0).to_bytes(8, "little") + int(w1).to_bytes(8, "little")
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def gap_index(seconds: float) -> int:
    return bisect.bisect_left(GAP_BOUNDS, seconds)

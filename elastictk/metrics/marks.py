"""Worker-side progress marks: what tells the agent a rank is alive besides optimizer steps.

A rank makes progress when it completes a step, a collective, a ``fault_point`` or a user
section (``with elastictk.section("eval"):``). Each mark is a few stores into the rank's slot
of the steps block (the progress words of :mod:`elastictk.metrics.layout`): the time of the
latest mark, and, once the process has made :data:`WARM_STEPS` steps (first steps and
compilation excluded), the gap since the mark before in a histogram the agent learns the job's
pace from (``elastictk/agent/pace.py``). A rank inside a collective says since when
(``COLL_SINCE``), so the agent can tell the rank that waits from the rank it waits for; a rank
inside a section says which, so a long section is judged against that section's own learned
duration.

The collectives are the ``torch.distributed`` calls made from Python, wrapped by
:func:`elastictk.metrics.blocked.time_collectives`; DDP's gradient all-reduces run in C++
inside ``backward()``, so once a ``DistributedDataParallel`` forward has run in the process,
``torch.autograd.backward`` counts as a collective (its end is the all-reduces' end). A call
with ``async_op=True`` counts when it returns, not when its work completes.

Outside an agent (no steps block) every call is a no-op. The agent turns the marks on with
``ELASTICTK_PROGRESS_MARKS=1`` (``--hang-detection learned``, the default).
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator, Optional

from ..timer.marksink import set_sink
from .layout import (
    COLL_SINCE, COLLECTIVES, GAP0, PROC_STEPS, PROGRESS_COUNT, PROGRESS_MONO, SECTION_LAST_NAME,
    SECTION_LAST_S, SECTION_NAME, SECTION_SINCE, SECTIONS_DONE, gap_index, name_words,
)

ENV_MARKS = "ELASTICTK_PROGRESS_MARKS"
WARM_STEPS = 3  # steps of a process before its gaps are learned from

_enabled = False
_bound: Any = None  # the process's slot (worker._Slot), bound when the worker maps it
_local = threading.local()  # section depth per thread (only the outermost is written)


def enable() -> None:
    """Turn the marks on in this process (the agent asked for them)."""
    global _enabled
    _enabled = True
    set_sink(mark, _outside)


def bind(slot: Any) -> None:
    """The worker mapped its slot (``elastictk.metrics.worker``), or a fork's child lost it."""
    global _bound
    _bound = slot


def _slot() -> Any:
    return _bound if _enabled else None


def note(q: Any, d: Any, b: int, now: float) -> None:
    """One progress mark at ``now`` in the slot at word ``b``."""
    last = d[b + PROGRESS_MONO]
    if last and q[b + PROC_STEPS] >= WARM_STEPS and now >= last:
        i = b + GAP0 + gap_index(now - last)
        q[i] += 1
    d[b + PROGRESS_MONO] = now
    q[b + PROGRESS_COUNT] += 1


def mark() -> None:
    """Progress that is not a step (``fault_point``, a section's edge)."""
    s = _slot()
    if s is not None:
        note(s.q, s.d, s.b, time.monotonic())


def collective_entered() -> None:
    s = _slot()
    if s is not None:
        s.d[s.b + COLL_SINCE] = time.monotonic()


def _outside() -> None:
    s = _slot()
    if s is not None:
        s.d[s.b + COLL_SINCE] = 0.0


def collective_left() -> None:
    s = _slot()
    if s is not None:
        q, d, b = s.q, s.d, s.b
        d[b + COLL_SINCE] = 0.0
        q[b + COLLECTIVES] += 1
        note(q, d, b, time.monotonic())


@contextlib.contextmanager
def section(name: str) -> Iterator[None]:
    """Mark a phase of the training script (an eval, a checkpoint save, a data re-shuffle).

    Its start and end are progress, and while a rank is inside it the agent judges the rank
    against the learned duration of this section (the first run of it is not learned from:
    until it has been seen, the fixed ``--progress-timeout`` applies) instead of the gap
    between steps. Sections nest; only the outermost is reported. Outside an agent, nothing.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"section name {name!r}: give a non-empty string, e.g. section('eval')")
    depth = getattr(_local, "depth", 0)
    s = _slot() if depth == 0 else None
    start = time.monotonic()
    if s is not None:
        q, d, b = s.q, s.d, s.b
        q[b + SECTION_NAME], q[b + SECTION_NAME + 1] = name_words(name)
        d[b + SECTION_SINCE] = start
        note(q, d, b, start)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth
        if s is not None:
            end = time.monotonic()
            q[b + SECTION_LAST_NAME], q[b + SECTION_LAST_NAME + 1] = name_words(name)
            d[b + SECTION_LAST_S] = end - start
            q[b + SECTIONS_DONE] += 1
            d[b + SECTION_SINCE] = 0.0
            note(q, d, b, end)


def active() -> Optional[bool]:
    """Whether marks reach an agent (None: not asked for)."""
    return None if not _enabled else _slot() is not None


__all__ = ["ENV_MARKS", "collective_entered", "collective_left", "enable", "mark", "note", "section"]

"""Where a layer below the metrics reports progress: ``fault_point`` (``elastictk.faults``)
cannot import ``elastictk.metrics``, so the metrics' progress marks (``metrics/marks.py``)
install themselves here when the agent asks for them, and :func:`mark` reaches them. Standard
library only; a no-op until then."""
from __future__ import annotations

from typing import Callable, Optional

_sink: Optional[Callable[[], None]] = None


def set_sink(fn: Optional[Callable[[], None]]) -> None:
    global _sink
    _sink = fn


def mark() -> None:
    """One progress mark (see ``elastictk/metrics/marks.py``), or nothing outside an agent."""
    if _sink is not None:
        _sink()

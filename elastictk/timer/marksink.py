"""Where a layer below the metrics reports progress: ``fault_point`` (``elastictk.faults``)
cannot import ``elastictk.metrics``, so the metrics' progress marks (``metrics/marks.py``)
install themselves here when the agent asks for them, and :func:`mark` reaches them. Standard
library only; a no-op until then."""
from __future__ import annotations

from typing import Callable, Optional

_sink: Optional[Callable[[], None]] = None
_outside: Optional[Callable[[], None]] = None


def set_sink(fn: Optional[Callable[[], None]], outside: Optional[Callable[[], None]] = None) -> None:
    global _sink, _outside
    _sink, _outside = fn, outside


def not_in_collective() -> None:
    """This rank never reached the collective it called (the ``hang-in-collective`` fault blocks
    before its contribution is sent): to the hang judge it is not inside one."""
    if _outside is not None:
        _outside()


def mark() -> None:
    """One progress mark (see ``elastictk/metrics/marks.py``), or nothing outside an agent."""
    if _sink is not None:
        _sink()

"""elastictk: fault-tolerant, elastic distributed PyTorch training as composable primitives."""
__version__ = "0.3.0"

from .supervisor.errors import record  # noqa: E402  (``@elastictk.record`` on a worker's main)


def __getattr__(name: str) -> object:
    """``elastictk.run_elastic`` / ``elastictk.State`` load the in-place loop (and torch) on use;
    ``elastictk.section`` marks a phase of the script for the hang judge."""
    if name in ("run_elastic", "State"):
        from . import inplace

        return getattr(inplace, name)
    if name == "section":  # ``with elastictk.section("eval"):`` (elastictk/metrics/marks.py)
        from .metrics.marks import section

        return section
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

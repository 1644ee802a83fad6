"""elastictk: fault-tolerant, elastic distributed PyTorch training as composable primitives."""
__version__ = "0.1.0"

from .supervisor.errors import record  # noqa: E402  (``@elastictk.record`` on a worker's main)

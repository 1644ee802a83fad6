"""elastictk: fault-tolerant, elastic distributed PyTorch training as composable primitives."""
__version__ = "0.1.0"

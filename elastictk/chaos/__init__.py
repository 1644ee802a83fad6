"""elastictk-chaos: a training job under a seeded, replayable fault plan, checked and reported."""
from .cli import main

__all__ = ["main"]

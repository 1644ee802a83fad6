"""elastictk-chaos: a training job under a seeded, replayable fault plan, checked and reported."""
from __future__ import annotations

from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``elastictk-chaos``'s main; its modules load on use, so ``python -m
    elastictk.chaos.timeline`` runs a module the package has not imported yet."""
    from .cli import main as cli_main

    return cli_main(argv)


__all__ = ["main"]

"""This process's rank and world size, for code that runs in a worker before or after a
process group exists: the sampler cuts its batches by them and ``State`` numbers its snapshot
parts by them. One reading, so the two never disagree about which rank a process is."""
from __future__ import annotations

import os


def rank_world() -> tuple[int, int]:
    """The default group's rank and size, else torchrun's ``RANK``/``WORLD_SIZE``, else (0, 1)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:  # pragma: no cover
        pass
    try:
        return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        raise ValueError(f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
                         "in the environment are not ints; launch with elastictk-run or torchrun, "
                         "or pass the rank and world size explicitly") from None

"""Process titles: every process of a job reads as what it is in ``ps``, ``top``, ``htop``,
``py-spy top`` and ``pgrep -f``.

A worker forked from the preload server would otherwise carry the server's command line
(``python -c import sys; from elastictk.supervisor.forkloop import serve; ...``), so every
worker, and the server, looked identical and ``pgrep -f train.py`` found nothing. Here a script
worker carries the command line torchrun would have run for it (``python -u train.py --lr 0.1``,
``python -u -m pkg.mod ...``) in ``/proc/<pid>/cmdline`` and its script's name in
``/proc/<pid>/comm``; the preload server reads ``elastictk-run: preload server (job <id>)``.
``setproctitle`` (the well-kept standard Ray, gunicorn and Celery use) rewrites the command
line; ``PR_SET_NAME`` sets the short name.
"""
from __future__ import annotations

import os
import shlex
import sys
from typing import Iterable

from ..lifetime.reaper import set_name


def set_title(title: str, name: str) -> None:
    """``title`` as the command line and ``name`` (15 bytes) as the short name."""
    try:
        import setproctitle
    except ImportError:  # pragma: no cover - an install without it: only the short name
        pass
    else:
        setproctitle.setproctitle(title)
    set_name(name)


def worker_title(kind: str, target: str, args: Iterable[str]) -> tuple[str, str]:
    """(command line, short name) torchrun's worker for this script or module would have."""
    argv = [sys.executable, "-u", *(("-m",) if kind == "module" else ()), target, *args]
    name = target.rsplit(".", 1)[-1] if kind == "module" else os.path.basename(target)
    return shlex.join(argv), name


def function_title(qualname: str, local_rank: int) -> tuple[str, str]:
    """A function worker: the function it runs and its local rank."""
    return f"elastictk worker {qualname} (local rank {local_rank})", f"et-{qualname}"[:15]


def server_title(job: str | None) -> tuple[str, str]:
    where = f" (job {job})" if job else ""
    return f"elastictk-run: preload server{where}", "et-preload"


def standby_title(job: str | None) -> tuple[str, str]:
    """A hot standby: no worker yet (no rank), waiting to replace one."""
    where = f" (job {job})" if job else ""
    return f"elastictk-run: standby worker{where}", "et-standby"

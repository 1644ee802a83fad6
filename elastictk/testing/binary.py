"""Finding the daemon binary a test or demo starts (etcd, Prometheus).

One rule for every daemon, so an operator learns it once: an explicit path wins, then an
environment variable (for a binary outside PATH without touching the code that starts it),
then PATH, then the Debian location.
"""
from __future__ import annotations

import os
import shutil


def find_binary(name: str, env_var: str, binary: str | os.PathLike[str] | None,
                not_found: type[Exception], hint: str) -> str:
    """``binary``, else ``$env_var``, else ``name`` on PATH, else ``/usr/bin/<name>``; raise
    ``not_found`` naming where it looked and ``hint`` (how to install it) otherwise."""
    chosen = binary or os.environ.get(env_var)
    for candidate in ([chosen] if chosen else [shutil.which(name), f"/usr/bin/{name}"]):
        if candidate and os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
            return str(candidate)
    where = f"at {chosen}" if chosen else f"on PATH or at /usr/bin/{name}"
    raise not_found(f"no {name} binary {where}; {hint}")

"""What the fork server and its standby import and call ahead, so a forked worker does not pay
for it: a script's installed-package imports (read from its top level), torch's first-call costs,
a throwaway one-rank gloo group. Apart from the server loop because it is about speed only:
every function here may fail and only costs time."""
from __future__ import annotations

import os
import sys
from typing import Any


def script_imports(path: str) -> list[str]:
    """The absolute imports at a script's top level (also inside top-level ``try``/``if``),
    in order: what its replacement would import first."""
    import ast

    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, (ast.Try, ast.If)):
            todo[:0] = list(node.body)
    return list(dict.fromkeys(names))


def warm_collectives() -> None:
    """Form, use and destroy a one-rank gloo group, in a standby only: the first group a process
    forms pays for lazy imports and first calls (5-15 ms here, measured), and a replacement's
    first act is to form one while its peers wait. Destroying the default group resets what
    forming it set (group names count from 0 again); its threads end with it. Not in the server:
    a fork does not carry threads over."""
    dist = sys.modules.get("torch.distributed")
    torch = sys.modules.get("torch")
    if dist is None or torch is None or not dist.is_available() or dist.is_initialized():
        return
    try:
        import datetime

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        t = torch.zeros(1)
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.all_gather([torch.zeros(1)], t)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - only speed is at stake
        pass


def prewarm(recipe: dict[str, Any]) -> None:
    """Import what the script imports from installed packages, ahead of its promotion.

    Only modules outside the script's directory and the working directory: the user's own
    modules may read the worker's environment (``RANK``, ``LOCAL_RANK``) at import, which the
    standby does not have yet; an installed library costs the same import time and, like the
    preloaded modules, sees the server's environment. Any failure only costs speed.
    """
    if recipe.get("kind") != "script" or not recipe.get("target"):
        return
    import importlib.util

    script = os.path.abspath(os.path.join(recipe["cwd"], recipe["target"]))
    local = {os.path.dirname(script), os.path.abspath(recipe["cwd"])}
    for name in script_imports(script):
        if name in sys.modules:
            continue
        try:
            spec = importlib.util.find_spec(name.split(".")[0])
            origin = (spec.origin or "") if spec is not None else ""
            if spec is None or any(origin.startswith(d + os.sep) for d in local):
                continue
            __import__(name)
        except BaseException:  # noqa: BLE001 - ImportError, SystemExit, anything: skip it
            continue


def warm() -> None:
    """Pay torch's first-call costs once, here, instead of in every forked worker.

    ``torch.manual_seed`` (the first line of most training scripts) queues a lazy CUDA seeding
    that captures a formatted stack, reading torch's source files into ``linecache`` (about
    6 ms); done here, the children inherit the cache. Seeding with ``initial_seed()`` leaves
    the generator exactly as a fresh interpreter has it. A one-element ``torch.save``/``load``
    round trip sets up the serialization paths an in-place recovery sends the state through
    (a few ms on each side). Nothing here starts a thread, which a fork would not carry over.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        import io

        torch.manual_seed(torch.initial_seed())
        buf = io.BytesIO()
        torch.save({"warm": torch.zeros(1)}, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception:  # noqa: BLE001 - only speed is at stake
        pass

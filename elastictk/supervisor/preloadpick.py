"""Which modules the preload server imports for a job: the default list, less ``torch._dynamo``
where the workers' script shows it will not use it.

``torch._dynamo`` is most of the server's own start (1.3-1.6 s of CPU on top of torch, measured
with torch 2.13), and it pays off only in workers that pull it in: building an optimizer, DDP,
FSDP, distributed checkpointing or ``torch.compile`` import it (measured); collectives, modules'
forward and backward, ``torch.save``/``load`` and ``DataLoader`` do not. A node start that
imports it for a probe, a smoke test or a collective-only job spends that CPU for nothing, on
every node of every start: a host running many small jobs (or a test suite) pays it hundreds
of times. So the script is read (never run): it keeps the full list unless it is a readable
Python file whose code (not its comments or strings) names none of those APIs and whose
imports are all the standard library, torch or elastictk. Any doubt keeps the full list. A
wrong guess only costs time: a worker that does import ``torch._dynamo`` after all pays it
itself, once per worker start.
"""
from __future__ import annotations

import ast
import os
import sys
from typing import Optional, Sequence

from .forkserver import DEFAULT_PRELOAD
from .spec import parse_python_argv

DYNAMO = "torch._dynamo"
# Names whose use imports torch._dynamo at run time (optimizers, DDP, FSDP, distributed
# checkpoint, compilers) or that say a training framework is at work: any of them in the
# script's code (not its comments or strings) keeps torch._dynamo in the preload list.
_USES_DYNAMO = frozenset({
    "optim", "optimizer", "compile", "_dynamo", "dynamo", "distributeddataparallel", "ddp", "fsdp",
    "fully_shard", "fullyshardeddataparallel", "checkpoint", "dcp", "parallel", "inductor",
    "export", "jit", "lightning", "transformers", "accelerate", "deepspeed",
})
_PLAIN_TOPS = frozenset({"torch", "elastictk"}) | frozenset(sys.stdlib_module_names)
_MAX_SCRIPT = 1 << 20  # a script larger than this is not read: the full list


def preload_for(argv: Sequence[str], cwd: Optional[str] = None) -> tuple[str, ...]:
    """The preload list for workers started as ``argv`` (``[python, -u, script, *args]``)."""
    if DYNAMO not in DEFAULT_PRELOAD or uses_dynamo(argv, cwd) is not False:
        return DEFAULT_PRELOAD
    return tuple(m for m in DEFAULT_PRELOAD if m != DYNAMO)


def uses_dynamo(argv: Sequence[str], cwd: Optional[str] = None) -> Optional[bool]:
    """False when the script plainly does not use torch._dynamo; True when its code names
    something that does; None when it cannot tell (a module, a non-Python command, a file
    that cannot be read or parsed, an import of another package or of the user's own code)."""
    target = parse_python_argv(argv)
    if target is None or target.kind != "script":
        return None
    path = os.path.join(cwd or os.getcwd(), target.target)
    try:
        if os.path.getsize(path) > _MAX_SCRIPT:
            return None
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.update(node.name.split("."))
            if node.asname:
                names.add(node.asname)
        elif isinstance(node, ast.ImportFrom):
            names.update((node.module or "").split("."))
        if isinstance(node, ast.Import):
            tops = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            tops = [(node.module or "").split(".")[0]] if node.level == 0 else [""]
        else:
            continue
        if any(t not in _PLAIN_TOPS for t in tops):
            return None  # another package, or the user's own module, may build an optimizer
    return any(n.lower() in _USES_DYNAMO for n in names)

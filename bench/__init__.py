"""elastictk benchmarks: each runs an elastictk part side by side with its torch counterpart.

Run them with ``python -m bench [name ...] [--quick] [--json PATH]``.

Adding a benchmark
------------------
Drop a module ``bench/<name>.py`` that defines::

    TITLE: str                                  # one line, used as the report's heading

    def run(cfg: bench.common.RunConfig) -> bench.common.BenchResult:
        '''Measure elastictk and the torch reference IN THE SAME RUN, interleaved
        (see bench.common.interleaved), and return one Comparison per case.'''

That is all the registration there is: every ``bench/*.py`` is a benchmark except ``common``,
``__main__`` and modules whose name starts with ``_`` (helpers such as ``_pool``). ``run`` must
honour ``cfg.quick`` (a seconds-long smoke run with tiny sizes), stop everything it started
before it returns (list helper PIDs in ``BenchResult.pids``), and never assert on speed.
"""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

_NOT_BENCHMARKS = {"common", "__main__"}


def available() -> list[str]:
    """The names of all benchmarks, in a stable order."""
    return sorted(
        m.name for m in pkgutil.iter_modules(__path__)
        if m.name not in _NOT_BENCHMARKS and not m.name.startswith("_")
    )


def load(name: str) -> ModuleType:
    """Import benchmark ``name`` and check it has the shape documented above."""
    if name not in available():
        raise ValueError(
            f"unknown benchmark {name!r}; choose from: {', '.join(available()) or '(none)'}"
        )
    module = importlib.import_module(f"{__name__}.{name}")
    title = getattr(module, "TITLE", None)
    if not callable(getattr(module, "run", None)) or not isinstance(title, str):
        raise ValueError(
            f"bench/{name}.py must define TITLE (str) and run(cfg) -> BenchResult; "
            f"rename it to bench/_{name}.py if it is a helper"
        )
    return module

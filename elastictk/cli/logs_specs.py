"""torchrun's ``--logs-specs NAME``: a ``LogsSpecs`` class from the ``torchrun.logs_specs``
entry-point group, made as torchrun makes it.

This is how platforms plug in their log layout (where each rank's stdout, stderr and error file
go); torchrun looks the name up in that group and builds the class from ``--log-dir``,
``--redirects``, ``--tee`` and ``--local-ranks-filter``. Doing the same here means a plugin
written for torchrun works unchanged; the workers' supervisor then asks the instance's
``reify`` where each attempt's streams go. A name that is not installed is one line listing
the ones that are (torch raises a ``ValueError`` naming only the missing key).
"""
from __future__ import annotations

from importlib import metadata
from typing import Mapping

from .values import Std, UsageError

GROUP = "torchrun.logs_specs"


def installed() -> list[str]:
    """The names in the ``torchrun.logs_specs`` group, sorted."""
    return sorted({ep.name for ep in metadata.entry_points(group=GROUP)})


def load_class(name: str, flag: str = "--logs-specs") -> type:
    """The class the entry point ``name`` names (the first, as torch takes it)."""
    found = list(metadata.entry_points(group=GROUP, name=name))
    if not found:
        names = ", ".join(installed()) or "none"
        raise UsageError(f"{flag} {name}: no entry point of that name in group '{GROUP}' "
                         f"(installed: {names}); install the package that provides it or pass "
                         "one of those")
    try:
        cls = found[0].load()
    except Exception as e:  # the plugin's import failed: say which and why, in one line
        raise UsageError(f"{flag} {name}: cannot load {found[0].value}: {type(e).__name__}: {e}; "
                         "fix or reinstall the package that provides it") from None
    if not isinstance(cls, type) or not callable(getattr(cls, "reify", None)):
        raise UsageError(f"{flag} {name}: {found[0].value} is not a LogsSpecs class (it has no "
                         "reify method); point the entry point at a LogsSpecs subclass")
    return cls


def build(name: str, flag: str, *, log_dir: str | None, redirects: "Std | Mapping[int, Std]",
          tee: "Std | Mapping[int, Std]", local_ranks_filter: frozenset[int] | None) -> object:
    """An instance of ``name``'s class with torchrun's arguments (torch's ``Std`` values)."""
    cls = load_class(name, flag)
    from torch.distributed.elastic.multiprocessing.api import Std as TorchStd

    def torch_std(value: "Std | Mapping[int, Std]") -> object:
        if isinstance(value, Mapping):
            return {rank: TorchStd(int(v)) for rank, v in value.items()}
        return TorchStd(int(value))

    try:
        return cls(log_dir=log_dir, redirects=torch_std(redirects), tee=torch_std(tee),
                   local_ranks_filter=set(local_ranks_filter) if local_ranks_filter else None)
    except Exception as e:
        raise UsageError(f"{flag} {name}: {cls.__name__}(...) failed: {type(e).__name__}: {e}; "
                         "check --log-dir and the other log flags") from None

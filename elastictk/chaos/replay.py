"""Reading an earlier chaos report back for ``--replay``: its plan, launcher flags and command,
and the multi-node options that start the same cluster again.

Apart from the report's assembly (``report.py``, which writes ``chaos-report.json``): this side
reads a file from disk that may be old, edited or not one elastictk-chaos wrote, so every field
is checked and a bad one is a :class:`~elastictk.faults.PlanError` naming it, never a traceback.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from ..faults import FaultPlan
from .report import SCHEMA

def replay_multinode(path: str, max_nodes: Optional[int] = None) -> Optional[dict[str, Any]]:
    """The multi-node options of an earlier report, or None for a single-node one.

    ``nodes`` comes back an int >= 1 (and <= ``max_nodes``) and ``rejoin_s`` None or seconds >= 0;
    a report that holds anything else raises :class:`~elastictk.faults.PlanError` naming the
    field (call :func:`load_replay` first: it reports a missing or unreadable file)."""
    from ..faults import PlanError

    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    m = d.get("multinode") if isinstance(d, dict) else None
    if m is None:
        return None
    fix = "pass the chaos-report.json an elastictk-chaos run wrote, or fix that field"
    if not isinstance(m, dict):
        raise PlanError(f"{path}: multinode is {_kind(m)}, not an object; {fix}")
    nodes = m.get("nodes", 1)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise PlanError(f"{path}: multinode.nodes is {_shown(nodes)}, not a whole number >= 1; {fix}")
    if max_nodes is not None and nodes > max_nodes:
        raise PlanError(f"{path}: multinode.nodes is {nodes}, more than {max_nodes} (each node is an agent "
                        f"process on this machine); {fix}")
    rejoin = m.get("rejoin_s")
    if rejoin is not None and (isinstance(rejoin, bool) or not isinstance(rejoin, (int, float))
                               or not 0 <= rejoin < float("inf")):
        raise PlanError(f"{path}: multinode.rejoin_s is {_shown(rejoin)}, not null or seconds >= 0; {fix}")
    return {**m, "nodes": nodes, "rejoin_s": None if rejoin is None else float(rejoin)}


def _kind(x: Any) -> str:
    """How a report field's JSON type is named in an error line."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(x), type(x).__name__)


def _shown(x: Any) -> str:
    """A report field's value for an error line: short, on one line."""
    text = json.dumps(x)
    return f"{_kind(x)} {text if len(text) <= 40 else text[:37] + '...'}"


def _strings(d: dict[str, Any], key: str, path: str) -> list[str]:
    """``d[key]``, a list of strings (absent: empty), or a PlanError naming the field."""
    from ..faults import PlanError

    value = d.get(key, [])
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        bad = value if not isinstance(value, list) else next(x for x in value if not isinstance(x, str))
        what = f"is {_shown(value)}" if not isinstance(value, list) else f"holds {_shown(bad)}"
        raise PlanError(f"{path}: {key} {what}, not a list of strings; pass the chaos-report.json an "
                        "elastictk-chaos run wrote, or fix that field")
    return value


def load_replay(path: str) -> tuple[FaultPlan, list[str], list[str]]:
    """The plan, launcher flags and command of an earlier report (``--replay``)."""
    from ..faults import PlanError

    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except OSError as e:
        raise PlanError(f"{path}: cannot read the chaos report: {e.strerror or e}") from None
    except ValueError as e:
        raise PlanError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        raise PlanError(f"{path}: not an elastictk chaos report (schema {SCHEMA!r}); pass the "
                        "chaos-report.json an elastictk-chaos run wrote")
    return (FaultPlan.from_json(d.get("plan"), f"{path}: plan"),
            _strings(d, "launcher_flags", path), _strings(d, "command", path))

"""A state tree as DCP takes it: each tensor under a flat string key, the rest a skeleton.

Apart from ``dcp.py`` (the disk tier's files, its seal and its process group) because it is
pure and stands on its own: the one mapping both a save and a load must agree on.
:func:`flatten` replaces each tensor in the state with ``{MARK: key}``, ``key`` the escaped
path to it (``objects/optimizer/state/#0/momentum_buffer``: ``/``, ``%`` and ``#`` in a
string key escaped, an integer index written ``#N``), and returns the tensors by key for DCP;
the skeleton (optimizer hyper-parameters, the step, the structure) goes to ``skeleton.pt``,
read back ``weights_only``. :func:`keys` lists the keys a skeleton expects, :func:`unflatten`
puts loaded tensors back in their places (dicts, ordered dicts, lists and tuples rebuilt).
"""
from __future__ import annotations

from typing import Any

from .reshard import remap

MARK = "__etk_dcp__"


def tensor_key(path: tuple[Any, ...]) -> str:
    """A DCP key for a tensor's path (``objects/optimizer/state/#0/momentum_buffer``)."""
    return "/".join(k.replace("%", "%25").replace("/", "%2F").replace("#", "%23")
                    if isinstance(k, str) else f"#{k}" for k in path)


def flatten(tree: Any) -> tuple[Any, dict[str, Any]]:
    """``tree`` with each tensor replaced by ``{MARK: key}``, and the tensors by key."""
    flat: dict[str, Any] = {}

    def mark(path: tuple[Any, ...], t: Any) -> Any:
        key = tensor_key(path)
        flat[key] = t
        return {MARK: key}

    return remap(tree, mark), flat


def unflatten(skeleton: Any, flat: dict[str, Any]) -> Any:
    from collections import OrderedDict

    if isinstance(skeleton, dict):
        if len(skeleton) == 1 and MARK in skeleton:
            return flat[skeleton[MARK]]
        out = OrderedDict() if isinstance(skeleton, OrderedDict) else {}
        for k, v in skeleton.items():
            out[k] = unflatten(v, flat)
        return out
    if isinstance(skeleton, list):
        return [unflatten(v, flat) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(unflatten(v, flat) for v in skeleton)
    return skeleton


def keys(skeleton: Any) -> list[str]:
    out: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if len(x) == 1 and MARK in x:
                out.append(x[MARK])
                return
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(skeleton)
    return out

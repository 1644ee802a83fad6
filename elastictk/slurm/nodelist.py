"""Slurm's hostlist syntax (``SLURM_JOB_NODELIST``) expanded to host names, and ``scontrol``'s
own expansion when it is installed.

Slurm compresses a node list: ``node[01-03,07],gpu-a[1-2]`` is ``node01 node02 node03 node07
gpu-a1 gpu-a2``. A bracket holds numbers and ranges; a range keeps the zero padding of its
lower bound (``[08-10]`` is ``08 09 10``); several brackets in one name expand as a product,
left to right (``r[1-2]n[1-2]`` is ``r1n1 r1n2 r2n1 r2n2``). The variable comes from outside
the process, so the parser refuses what Slurm never writes (nested or unbalanced brackets,
descending ranges, characters no host name has) in one line, and caps the expansion at
:data:`MAX_HOSTS` so a hostile ``[0-999999999]`` cannot take the memory.
"""
from __future__ import annotations

import itertools
import re
import shutil
import subprocess

#: Slurm's own limit on nodes in a job is 65,533 (MAX_SLURM_NODES is 64k); a list expanding
#: to more is not one Slurm wrote.
MAX_HOSTS = 65536
#: Digits in one number of a bracket: Slurm keeps them in 64 bits. Longer is not Slurm's, and
#: Python refuses to read an int of more than 4,300 digits (a ValueError, not this module's).
MAX_DIGITS = 18
_NAME = re.compile(r"[A-Za-z0-9._-]*")
_NUMBER = re.compile(r"[0-9]+")


class NodelistError(ValueError):
    """A node list that is not Slurm's syntax; ``str()`` is one line naming the problem."""


def expand(text: str) -> list[str]:
    """The host names of Slurm node list ``text``, in Slurm's order (duplicates kept)."""
    if not text.strip():
        raise NodelistError("empty node list")
    hosts: list[str] = []
    for item in _split_top(text):
        if not item:
            raise NodelistError(f"{text!r}: an empty name between commas")
        for host in _expand_item(item, text):
            hosts.append(host)
            if len(hosts) > MAX_HOSTS:
                raise NodelistError(f"{text[:80]!r}: expands to more than {MAX_HOSTS} hosts")
    return hosts


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise NodelistError(f"{text!r}: nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise NodelistError(f"{text!r}: ']' without '[' at position {i}")
        elif ch == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    if depth:
        raise NodelistError(f"{text!r}: '[' without ']'")
    items.append(text[start:].strip())
    return items


def _expand_item(item: str, text: str) -> list[str]:
    """One name with bracket groups: the product of its parts, left to right."""
    parts: list[list[str]] = []
    rest = item
    while rest:
        name = _NAME.match(rest)
        assert name is not None  # the pattern matches the empty string
        if name.group():
            parts.append([name.group()])
            rest = rest[name.end():]
            continue
        if rest[0] != "[":
            raise NodelistError(f"{text!r}: {rest[0]!r} is not part of a host name")
        close = rest.index("]")  # balanced: checked by _split_top
        parts.append(_expand_bracket(rest[1:close], text))
        rest = rest[close + 1:]
    total = 1
    for p in parts:
        total *= len(p)
        if total > MAX_HOSTS:
            raise NodelistError(f"{text[:80]!r}: expands to more than {MAX_HOSTS} hosts")
    return ["".join(combo) for combo in itertools.product(*parts)]


def _expand_bracket(body: str, text: str) -> list[str]:
    """``01-03,07`` to ``01 02 03 07``: numbers, and ranges padded as their lower bound."""
    out: list[str] = []
    for piece in body.split(","):
        lo, dash, hi = (s.strip() for s in piece.partition("-"))
        if not _NUMBER.fullmatch(lo) or (dash and not _NUMBER.fullmatch(hi)):
            raise NodelistError(f"{text!r}: [{body}] holds {piece!r}, not a number or a range "
                                "like 01-03")
        longest = max(lo, hi, key=len)
        if len(longest) > MAX_DIGITS:
            raise NodelistError(f"{text[:80]!r}: [{body[:40]}...] holds a number of {len(longest)} "
                                f"digits, and Slurm's have at most {MAX_DIGITS}")
        if not dash:
            out.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a:
            raise NodelistError(f"{text!r}: range {piece} runs backwards")
        if b - a + 1 + len(out) > MAX_HOSTS:
            raise NodelistError(f"{text[:80]!r}: expands to more than {MAX_HOSTS} hosts")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(a, b + 1))
    return out


def scontrol_hostnames(text: str, timeout: float = 10.0) -> list[str] | None:
    """``scontrol show hostnames TEXT``: Slurm's own expansion, or None when scontrol is not
    installed or does not answer (the parser's is used then)."""
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "show", "hostnames", text], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    hosts = done.stdout.split()
    return hosts if done.returncode == 0 and hosts else None

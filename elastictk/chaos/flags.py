"""``elastictk-chaos``'s own flags checked before anything runs: one line naming the flag and
the fix for each bad value, so a typo never starts a training job (or a ten-minute wait) and
never surfaces as a traceback or as a plan generator's internal parameter name.

The generator (:mod:`elastictk.faults.knobs`) checks the same values again in its own terms
(``count``, ``steps window``); :func:`in_flag_terms` rewrites what it still refuses (a kind that
needs the other window, a hang without a collective timeout, faults that do not fit) into the
flags a user typed.
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Optional

from .._paths import Unsafe, make_own_dir

PROG = "elastictk-chaos"

#: ``--faults`` at most: each is a separate restart of the job; a plan of more is a typo.
MAX_FAULTS = 1000
#: ``--at-seconds`` at most (the generator's bound): about 30 years.
MAX_SECONDS = 1e9
#: A ``--replay`` report larger than this is not one elastictk-chaos wrote.
MAX_REPORT_BYTES = 256 << 20


class FlagError(ValueError):
    """One line: the flag, its value, what is wrong and what to write instead."""


class Usage(Exception):
    """A command line that cannot run (no training command, a flag argparse refuses, a plan or
    flags that do not fit the job): one line, exit 2."""


def _seconds(flag: str, value: float, example: str) -> None:
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise FlagError(f"{flag} {value:g}: give a finite number of seconds more than 0 (at most "
                        f"{MAX_SECONDS:g}), e.g. {flag} {example}")


def check_flags(ns: argparse.Namespace) -> None:
    """Every value of elastictk-chaos's own flags that can be judged alone."""
    _seconds("--timeout", ns.timeout, "600")
    if ns.ckpt_every is not None and ns.ckpt_every < 1:
        raise FlagError(f"--ckpt-every {ns.ckpt_every}: give the job's checkpoint interval in "
                        "steps, at least 1 (e.g. --ckpt-every 5), or leave it out")
    if not 0 <= ns.faults <= MAX_FAULTS:
        raise FlagError(f"--faults {ns.faults}: give a number of faults from 0 to {MAX_FAULTS}, "
                        "e.g. --faults 2")
    if ns.kinds is not None and not [k for k in ns.kinds.split(",") if k.strip()]:
        raise FlagError(f"--kinds {ns.kinds!r}: name at least one kind, e.g. --kinds "
                        "sigkill,exception, or leave --kinds out for the default kinds")
    if ns.rejoin is not None and not (math.isfinite(ns.rejoin) and 0 <= ns.rejoin <= MAX_SECONDS):
        raise FlagError(f"--rejoin {ns.rejoin:g}: give a finite number of seconds >= 0, e.g. "
                        "--rejoin 5")
    if ns.at_seconds is not None:
        window("--at-seconds", ns.at_seconds, float)
    else:
        window("--at-steps", ns.at_steps, int)


def window(flag: str, text: str, typ: type) -> tuple:
    """``LO:HI`` of ``--at-steps`` (whole steps) or ``--at-seconds``: 0 <= LO < HI."""
    example = f"{flag} {'2:10' if typ is int else '3:8'}"
    lo, sep, hi = text.partition(":")
    try:
        pair = (typ(lo), typ(hi))
    except ValueError:
        pair = None
    if not sep or pair is None:
        raise FlagError(f"{flag} {text!r}: write LO:HI, e.g. {example}")
    if not all(math.isfinite(x) for x in pair):
        raise FlagError(f"{flag} {text}: LO and HI must be finite numbers, e.g. {example}")
    top = MAX_SECONDS if typ is float else math.inf
    if not 0 <= pair[0] < pair[1] <= top:
        raise FlagError(f"{flag} {text}: LO must be at least 0 and less than HI, e.g. {example}")
    return pair


def check_never(text: str, world: int) -> tuple[int, ...]:
    """``--never``'s ranks, each one of the job's."""
    try:
        ranks = tuple(int(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise FlagError(f"--never {text!r}: write rank numbers, e.g. --never 0,1") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise FlagError(f"--never {text}: the job has ranks 0..{world - 1}; drop rank {bad[0]} or "
                        "raise --nproc-per-node")
    return ranks


def in_flag_terms(problem: str, ns: argparse.Namespace) -> str:
    """A plan generator's refusal, with its parameter names replaced by the flags behind them."""
    window_flag = "--at-seconds" if ns.at_seconds is not None else "--at-steps"
    for internal, flag in (("seconds=(lo, hi)", "--at-seconds LO:HI"),
                           ("steps=(lo, hi)", "--at-steps LO:HI"),
                           ("watchdog_s (the job's collective timeout)", "--collective-timeout"),
                           ("drop it from kinds", "drop it from --kinds"),
                           ("lower count", "lower --faults"),
                           ("widen the window", f"widen {window_flag}")):
        problem = problem.replace(internal, flag)
    if problem.startswith("kinds: "):
        problem = problem[len("kinds: "):]
    if problem.startswith("kind") or "--kinds" in problem or "unknown fault kind" in problem:
        return f"--kinds {ns.kinds}: {problem}"
    if problem.startswith("cannot fit"):
        value = ns.at_seconds if ns.at_seconds is not None else ns.at_steps
        return f"--faults {ns.faults} with {window_flag} {value}: {problem}"
    return problem


def report_dir(text: str) -> Path:
    """Create ``--report-dir`` (and its parents) now, before the job, or say why not. A directory
    another user made first (in a shared ``/tmp``), or one others can write, is refused: whoever
    can write it can plant a symlink where the report goes or a module where Python looks."""
    out = Path(text)
    blocker: Optional[Path] = None
    for parent in (out, *out.parents):
        if parent.exists() or parent.is_symlink():
            blocker = None if parent.is_dir() else parent
            break
    if blocker is not None:
        where = "is a file" if blocker == out else f"is under {blocker}, a file"
        raise FlagError(f"--report-dir {text}: {where}, not a directory; pick a directory, e.g. "
                        "--report-dir chaos-report")
    try:  # made 0700 if missing; an existing one must be this user's, not writable by others
        make_own_dir(out, "report directory")
    except OSError as e:
        raise FlagError(f"--report-dir {text}: cannot create it ({e.strerror or e}); pick a "
                        "directory you can write") from None
    except Unsafe as e:
        raise FlagError(f"--report-dir {text}: {e}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise FlagError(f"--report-dir {text}: not writable; pick a directory you can write")
    return out

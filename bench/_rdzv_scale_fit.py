"""The verdicts of the rendezvous scale benchmark, as pure functions of the measured numbers.

A target passes only on numbers that meet it, and each can fail: the formation target compares
the measured time with its limit, and "the store's load grows at most linearly with the
nodes" fits ``load = a * nodes ** b`` by least squares in log-log space and fails when the
exponent ``b`` is past ``MAX_EXPONENT`` (a quadratic protocol measures ``b`` near 2). The fit is
taken over the sizes from ``FIT_FROM`` nodes on, where per-node work dominates the fixed cost
of a job, and also over the two largest sizes alone, so a protocol that turns quadratic only at
the top of the range is flagged too.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

#: Above this exponent the load grows faster than linearly (noise on a shared machine moves
#: a linear curve's exponent by a few hundredths; a quadratic one sits near 2).
MAX_EXPONENT = 1.25
#: The two largest sizes alone: noisier (two points), so a wider margin.
MAX_TOP_EXPONENT = 1.4
FIT_FROM = 32


@dataclass(frozen=True)
class Verdict:
    """One target: what was asked, what was measured, and whether it holds.

    ``passed`` is None when the run could not tell (too few sizes, a size that failed): that
    is said, never counted as a pass.
    """

    target: str
    measured: str
    passed: bool | None

    @property
    def word(self) -> str:
        return {True: "PASS", False: "FAIL", None: "UNKNOWN"}[self.passed]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.word}


def exponent(nodes: Sequence[float], values: Sequence[float]) -> float:
    """The least-squares slope of log(values) against log(nodes): ``b`` in ``a * n ** b``."""
    if len(nodes) != len(values) or len(nodes) < 2:
        raise ValueError("an exponent needs at least two (nodes, value) points")
    if any(not (n > 0 and v > 0 and math.isfinite(n) and math.isfinite(v)) for n, v in zip(nodes, values)):
        raise ValueError("an exponent needs positive, finite nodes and values")
    xs = [math.log(n) for n in nodes]
    ys = [math.log(v) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("an exponent needs at least two different node counts")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def linear_growth(what: str, nodes: Sequence[int], values: Sequence[float | None]) -> Verdict:
    """Whether ``values`` (a load per second at each node count) grows at most linearly."""
    target = f"{what} grows at most linearly with nodes (fitted exponent <= {MAX_EXPONENT:g})"
    pts = sorted((n, v) for n, v in zip(nodes, values) if v is not None and v > 0 and n >= FIT_FROM)
    if len(pts) < 2:
        return Verdict(target, f"too few sizes measured from {FIT_FROM} nodes on ({len(pts)})", None)
    b = exponent([n for n, _ in pts], [v for _, v in pts])
    top = exponent([n for n, _ in pts[-2:]], [v for _, v in pts[-2:]])
    measured = (f"exponent {b:.2f} over {pts[0][0]}..{pts[-1][0]} nodes, {top:.2f} between "
                f"{pts[-2][0]} and {pts[-1][0]} (limit {MAX_TOP_EXPONENT:g})")
    return Verdict(target, measured, b <= MAX_EXPONENT and top <= MAX_TOP_EXPONENT)


def formed_within(backend: str, nodes: int, seconds: float | None, limit: float,
                  what: str = "forms") -> Verdict:
    """Whether a round of ``nodes`` formed (``what``: how far) within ``limit`` seconds."""
    target = f"a {nodes:,}-node round {what} in < {limit:g} s on {backend}"
    if seconds is None:
        return Verdict(target, f"no {nodes:,}-node round was measured", None)
    return Verdict(target, f"{seconds:.2f} s", seconds < limit)

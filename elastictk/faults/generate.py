"""Generate a fault plan from a seed and a few knobs: the same seed and knobs give the same plan.

All randomness comes from one ``random.Random(seed)`` drawn in a fixed order (positions, then
per fault: kind, parameter, target), never from the global generator, so a plan is replayable
from its seed on any machine and Python version that keeps ``random``'s documented
reproducibility (``Random.choices``/``choice``/``uniform`` with the same seed).

Positions are integers (steps, or milliseconds for time faults) so spacing is exact: with
``y`` sorted draws from a range shortened by ``(count - 1) * gap``, ``x_i = y_i + i * gap`` has
every consecutive gap ``>= gap`` and stays inside the window.
"""
from __future__ import annotations

import math
import random
from typing import Any, Optional

from .kinds import KINDS, PlanError, Param, parse_kind
from .knobs import REJOIN_MARGIN_S, Knobs
from .plan import Fault, FaultPlan
from .target import Target


def generate(seed: int, knobs: Knobs) -> FaultPlan:
    """A plan of ``knobs.count`` faults drawn with ``random.Random(seed)`` (see :class:`Knobs`).

    Raises :class:`PlanError` (one line) when the knobs cannot be satisfied: every rank
    excluded, or more faults than fit in the window at the requested spacing.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise PlanError(f"seed {seed!r} must be an integer")
    rng = random.Random(seed)
    kinds = knobs.kinds or knobs.default_kinds()
    if knobs.steps is not None:
        lo, hi = knobs.steps
        positions = _spaced(rng, lo, hi, knobs.count, knobs.min_gap_steps,
                            lambda: f"{knobs.count} faults {knobs.min_gap_steps} steps apart in "
                                    f"steps {lo}..{hi - 1}")
    else:
        assert knobs.seconds is not None
        lo_ms = math.ceil(knobs.seconds[0] * 1000)
        hi_ms = math.ceil(knobs.seconds[1] * 1000)
        gap_ms = math.ceil(knobs.min_gap_s * 1000)
        positions = _spaced(rng, lo_ms, hi_ms, knobs.count, gap_ms,
                            lambda: f"{knobs.count} faults {knobs.min_gap_s:g}s apart in "
                                    f"{knobs.seconds[0]:g}-{knobs.seconds[1]:g}s")
    ranks = [r for r in range(knobs.world_size) if r not in set(knobs.never)]
    per_node = knobs.world_size // knobs.nodes
    nodes = [n for n in range(knobs.nodes)
             if not any(n * per_node <= r < (n + 1) * per_node for r in knobs.never)]
    for spec in kinds:  # fail on the knobs, not on whichever kind the seed happens to draw
        _target(None, parse_kind(spec.strip() + _bare_param(spec))[0], ranks, nodes, knobs)
    faults = []
    down: dict[int, float] = {}  # node -> when it runs again (inf: not in this plan)
    for pos in positions:
        now = pos / 1000 if knobs.steps is None else 0.0
        killed = {n for n, back in down.items() if back > now}
        spec = rng.choice(kinds)
        if parse_kind(spec.strip() + _bare_param(spec))[0] == "kill-agent" and not _alive(nodes, killed, knobs):
            spec = _instead_of_kill(rng, kinds, knobs)
        name, param = _kind(rng, spec, knobs)
        target = _target(rng, name, ranks, [n for n in nodes if n not in killed], knobs)
        if name == "kill-agent" and target.index is not None:
            down[target.index] = _back_at(now, knobs)
        when: dict[str, Any] = ({"at_step": pos} if knobs.steps is not None
                                else {"at_s": pos / 1000})
        faults.append(Fault(name, target, param=param, **when))
    return FaultPlan(tuple(faults), watchdog_s=knobs.watchdog_s, seed=seed, knobs=knobs)


def _back_at(killed_at: float, knobs: Knobs) -> float:
    """When a node killed at ``killed_at`` can be killed again: once chaos restarted its agent
    (``rejoin_s``, time faults only) and it had time to join; never without a rejoin."""
    if knobs.rejoin_s is None or knobs.steps is not None:
        return math.inf
    return killed_at + knobs.rejoin_s + REJOIN_MARGIN_S


def _alive(nodes: list[int], killed: set[int], knobs: Knobs) -> list[int]:
    """The nodes a kill-agent may still hit: not spared, not killed by an earlier fault."""
    return [n for n in nodes if n not in killed and n not in set(knobs.spare_nodes)]


def _instead_of_kill(rng: random.Random, kinds: tuple[str, ...] | list[str], knobs: Knobs) -> str:
    """Every node a kill-agent may hit is killed already: another of the plan's kinds is drawn,
    since a kill aimed at a node that is not running cannot fire."""
    others = [k for k in kinds if parse_kind(k.strip() + _bare_param(k))[0] != "kill-agent"]
    if not others:
        raise PlanError(f"more kill-agent faults than nodes that can be killed ({knobs.nodes} node(s), "
                        f"spare_nodes={list(knobs.spare_nodes)}): a second kill of a node finds it not "
                        "running; lower the count, add nodes or another kind, or (with --rejoin) leave "
                        f"{REJOIN_MARGIN_S:g}s past the rejoin between kills of one node")
    return rng.choice(others)


def _spaced(rng: random.Random, lo: int, hi: int, count: int, gap: int,
            what: Any) -> list[int]:
    """``count`` sorted integers in ``[lo, hi)``, consecutive ones at least ``gap`` apart."""
    if count == 0:
        return []
    room = hi - lo - (count - 1) * gap
    if room <= 0:
        raise PlanError(f"cannot fit {what()}: lower count or the gap, or widen the window")
    ys = sorted(rng.choices(range(lo, lo + room), k=count))
    return [y + i * gap for i, y in enumerate(ys)]


def _kind(rng: random.Random, spec: str, knobs: Knobs) -> tuple[str, Param]:
    """A kind written in the knobs; a bare parametrized kind gets its parameter drawn."""
    name = spec.strip()
    info = KINDS.get(name)
    if info is None or info.param is None:
        return parse_kind(spec)
    if info.param == "code":
        return name, rng.randint(1, 125)  # above 128 an exit code reads as a signal
    lo, hi = knobs.slow_s if name == "slow" else knobs.outage_s
    # Floor to hundredths so the drawn value never exceeds hi (which knobs keep below the
    # watchdog for stragglers).
    return name, max(0.01, math.floor(rng.uniform(lo, hi) * 100) / 100)


def _bare_param(spec: str) -> str:
    info = KINDS.get(spec.strip())
    return "" if info is None or info.param is None else ":1"


def _target(rng: Optional[random.Random], name: str, ranks: list[int], nodes: list[int],
            knobs: Knobs) -> Target:
    targets = KINDS[name].targets
    if "store" in targets:
        return Target("store")
    if targets == frozenset({"node"}):
        nodes = [n for n in nodes if n not in set(knobs.spare_nodes)]
        if not nodes:
            raise PlanError(f"kind {name!r} needs a node with no rank in never={list(knobs.never)}"
                            f" and not in spare_nodes={list(knobs.spare_nodes)}; there is none: "
                            "shrink them, add nodes or drop the kind")
        return Target.node(rng.choice(nodes) if rng else nodes[0])
    if not ranks:
        raise PlanError(f"every rank of world_size {knobs.world_size} is in never; leave at "
                        "least one rank to hit")
    return Target.rank(rng.choice(ranks) if rng else ranks[0])


def generate_plan(seed: int, count: int, world_size: int, *, kinds: Optional[list[str]] = None,
                  **knobs: Any) -> FaultPlan:
    """Keyword shortcut: ``generate_plan(7, 3, 4, steps=(5, 50), never=[0])``."""
    return generate(seed, Knobs(count=count, world_size=world_size,
                                kinds=tuple(kinds) if kinds is not None else None, **knobs))

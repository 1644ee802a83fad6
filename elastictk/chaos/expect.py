"""What a multi-node job must do under the faults that fired: finish or fail, and why. A pure
decision (no processes, no clock), so hypothesis can check it on its own and the report only
compares it with what happened.

The rules, in the order they win:

1. Under c10d, node 0's agent hosts the store. Killing it takes the store with it: every other
   node loses the store and exits 1 naming it. The job fails, whatever the budget.
2. A node killed without ``--rejoin`` does not come back. When fewer than ``--nnodes`` MIN
   nodes remain, the survivors cannot form a round and the job fails (after the rendezvous's
   join timeout).
3. Otherwise the restart budget decides, as on one node: the job finishes iff the failures
   that needed a restart are at most ``--max-restarts`` (and fails with the budget message).

A node's loss itself spends no restart: it is a membership change. It spends one when a
survivor's worker fails first (its collective with the lost ranks breaks before the survivors'
agents see the missing heartbeat); the report counts such a kill among the failures, from the
event log, not from a guess.

A store outage shorter than the heartbeat timeout is ridden through: no restart, no membership
change. A longer one may end in either (the nodes fence themselves and re-form once the store
is back) or in a failure naming the store; the job's outcome is then not decided here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass(frozen=True)
class Shape:
    """The job: ``nodes`` agents started, ``--nnodes min_nodes:...``, the backend, the restart
    budget, the rendezvous heartbeat timeout, and whether killed nodes rejoin."""

    nodes: int
    min_nodes: int
    backend: str
    max_restarts: int
    heartbeat_timeout: float
    rejoin: bool = False


@dataclass(frozen=True)
class Expectation:
    """``finish``: True/False, or None when either is right (a long store outage).
    ``names``: a phrase the failure must name in the agents' stderr (None: not checked)."""

    finish: Optional[bool]
    why: str
    names: Optional[str] = None


BUDGET = "restart budget spent"
STORE = "store"


def long_outage(seconds: float, shape: Shape) -> bool:
    """Whether an outage this long may be taken for lost nodes (not ridden through)."""
    return seconds >= shape.heartbeat_timeout


def expect(shape: Shape, restarts_needed: int, killed: Iterable[int] = (),
           outages: Iterable[float] = ()) -> Expectation:
    """The outcome a correct job has, given the failures that needed a restart, the nodes whose
    agent was killed and the store outages (seconds) that fired."""
    killed = set(killed)
    if shape.backend == "c10d" and 0 in killed:
        return Expectation(False, "node 0 hosted the c10d store and was killed", STORE)
    left = shape.nodes if shape.rejoin else shape.nodes - len(killed)
    if left < shape.min_nodes:
        return Expectation(False, f"{left} node(s) left, fewer than --nnodes min {shape.min_nodes}")
    if restarts_needed > shape.max_restarts:
        return Expectation(False, f"{restarts_needed} failure(s) needed a restart, "
                                  f"--max-restarts {shape.max_restarts}", BUDGET)
    longs = [s for s in outages if long_outage(s, shape)]
    if longs:
        return Expectation(None, f"a store outage of {max(longs):g}s >= heartbeat timeout "
                                 f"{shape.heartbeat_timeout:g}s may restart, re-form or fail", STORE)
    why = f"{restarts_needed} failure(s) needed a restart, --max-restarts {shape.max_restarts}"
    if killed:
        why += f"; {left} node(s) left, --nnodes min {shape.min_nodes}"
    return Expectation(True, why)


def short_of_nodes(shape: Shape, killed: Iterable[int], join_timeout: float) -> Optional[str]:
    """The line said before a run whose plan kills so many agents (without ``--rejoin``) that
    fewer than ``--nnodes`` MIN nodes are left: the survivors then wait for nodes up to the join
    timeout before the job fails (rule 2), which is what a correct job does, and the report judges
    it so; the line says what the run is waiting for meanwhile. None for any other plan."""
    killed = sorted(set(killed))
    if shape.rejoin or not killed:
        return None
    left = shape.nodes - len(killed)
    if left >= shape.min_nodes:
        return None
    return (f"the plan kills node(s) {', '.join(map(str, killed))} with no --rejoin: {left} node(s) "
            f"will be left, fewer than --nnodes min {shape.min_nodes}, so the job then waits up to "
            f"the join timeout ({join_timeout:g}s) for nodes and fails, as it should (the report "
            "expects that); shorten the wait with --rdzv-conf join_timeout=SECONDS, or plan fewer "
            "kill-agent faults")

"""Where the time of one propagation launch went, read off its timeline; and the notes about it.

Each launcher's agents say when they act, in their own words: elastictk-run logs
``worker_failed`` (one of its own workers exited, and it published that in the store) or
``peer_failed`` (another node published a failure), torchrun with ``LOGLEVEL=INFO`` logs
``Worker group FAILED`` (one of its own workers exited) or ``Detected N new nodes`` (a peer is
waiting in the next rendezvous). The first such line of a node after the kill is when that
node's agent reacted, and which line it was says how the failure reached it: through the
launcher's own control plane, or through the data plane (gloo's TCP connections to the dead
worker reset, the survivors' ``all_reduce`` raised, and they exited on their own).
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Literal, Optional

from ._propagation_job import Timeline
from .common import BenchError, fmt

Kind = Literal["elastictk", "torch"]

REACTIONS: dict[str, tuple[str, ...]] = {
    "elastictk": ("worker_failed", "peer_failed", "membership_changed"),
    "torch": ("torch_group_failed", "torch_peer_waiting"),
}
# Reactions that mean "one of my own workers exited" rather than "a peer told me".
OWN_EXIT = {"worker_failed", "torch_group_failed"}
REACTION_TEXT = {
    "worker_failed": "its own worker's exit (worker_failed)",
    "peer_failed": "the failure key another agent wrote to the store (peer_failed)",
    "membership_changed": "a membership change",
    "torch_group_failed": "its own worker's exit (Worker group FAILED)",
    "torch_peer_waiting": "a peer waiting in the next rendezvous (Detected 1 new nodes)",
}
PHASE_TEXT = {
    "victim_agent": "the victim's agent reacted",
    "agents_reacted": "the last agent reacted",
    "restart_decided": "restart decided",
    "rounds_joined": "every node joined the new round",
    "workers_started": "every node started its workers",
    "first_resumed": "first rank resumed",
}


@dataclass
class Sample:
    """One launch with a SIGKILL: the timings (seconds after the kill) and how it unfolded."""

    stopped: float  # every worker of the killed attempt terminated
    reacted: float  # every agent logged that it stops its workers
    stepping: float  # every rank stepped in the attempt that ran to the end
    exits: dict[int, float]  # rank -> its worker's termination
    node_of: dict[int, int]  # rank -> launcher index
    reactions: dict[int, tuple[float, str]]  # node -> (time, what it reacted to)
    phases: dict[str, float]
    root_cause: Optional[str]  # elastictk's job-wide restart reason
    checksum: str
    frozen_stopped: Optional[int] = None  # workers stopped while the victim was SIGSTOPped

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["exits"] = {str(r): t for r, t in sorted(self.exits.items())}
        d["node_of"] = {str(r): n for r, n in sorted(self.node_of.items())}
        d["reactions"] = {str(n): list(v) for n, v in sorted(self.reactions.items())}
        return d


def analyse(kind: Kind, tl: Timeline, t_kill: float, exited: dict[int, float],
            node_of: dict[int, int], nodes: int, victim: int, checksum: str) -> Sample:
    """A Sample from a finished launch's timeline and the workers' exit times (monotonic)."""
    world = len(node_of)
    firsts = tl.first_step_of_last_attempt(world, t_kill)
    if firsts is None:
        raise BenchError("not every rank stepped after the restart")
    reactions: dict[int, tuple[float, str]] = {}
    for n in range(nodes):
        evs = [(t - t_kill, name) for t, node, name, _ in tl.events
               if node == n and t >= t_kill and name in REACTIONS[kind]]
        if not evs:
            raise BenchError(f"node {n}'s agent logged no reaction to the failure "
                             f"(none of {', '.join(REACTIONS[kind])})")
        reactions[n] = min(evs)
    victim_node = node_of[victim]

    def last_on_every_node(name: str) -> Optional[float]:
        ts = [tl.event(name, t_kill, n) for n in range(nodes)]
        return None if any(e is None for e in ts) else max(e[0] for e in ts if e) - t_kill

    phases = {"victim_agent": reactions[victim_node][0],
              "agents_reacted": max(t for t, _ in reactions.values())}
    root_cause = None
    if kind == "elastictk":
        restart = tl.event("restart", t_kill)
        if restart is not None:
            phases["restart_decided"] = restart[0] - t_kill
            root_cause = restart[2].split("reason=", 1)[-1]
        marks = {"rounds_joined": "round_joined", "workers_started": "workers_started"}
    else:
        marks = {"workers_started": "torch_starting"}
    for phase, event in marks.items():
        t = last_on_every_node(event)
        if t is not None:
            phases[phase] = t
    resumed = [t for t, _, _, _ in tl.resumed if t >= t_kill]
    if resumed:
        phases["first_resumed"] = min(resumed) - t_kill
    exits = {r: t - t_kill for r, t in exited.items()}
    return Sample(
        stopped=max(exits.values()), reacted=phases["agents_reacted"],
        stepping=max(firsts.values()) - t_kill, exits=exits, node_of=dict(node_of),
        reactions=reactions, phases=phases, root_cause=root_cause, checksum=checksum,
    )


def sample_notes(label: str, kind: Kind, ss: list[Sample], victim: int) -> list[str]:
    """Per launcher: where the stop time went, how the other nodes learned, the restart phases."""
    if not ss:
        return []
    med = statistics.median

    def remote(s: Sample) -> list[float]:
        return [t for r, t in s.exits.items() if s.node_of[r] != s.node_of[victim]]

    mate = [t for s in ss for r, t in s.exits.items()
            if r != victim and s.node_of[r] == s.node_of[victim]]
    stops = (f"{label}, median seconds after the kill: the victim's pidfd fired "
             f"{fmt(med(s.exits[victim] for s in ss))}, its node-mate stopped {fmt(med(mate))}, "
             f"the first worker on another node {fmt(med(min(remote(s)) for s in ss))}, the last "
             f"{fmt(med(max(remote(s)) for s in ss))}")
    keys = [k for k in PHASE_TEXT if all(k in s.phases for s in ss)]
    phases = "; ".join(f"{PHASE_TEXT[k]} {fmt(med(s.phases[k] for s in ss))}" for k in keys)
    counts: dict[str, int] = {}
    own = 0
    for s in ss:
        for n, (_, name) in s.reactions.items():
            if n != s.node_of[victim]:
                counts[name] = counts.get(name, 0) + 1
                own += name in OWN_EXIT
    learned = ", ".join(f"{REACTION_TEXT.get(k, k)} ×{v}" for k, v in sorted(counts.items()))
    out = [f"{stops}; {phases}",
           f"{label}: the other nodes' agents (2 per launch) first reacted to: {learned}"]
    if kind == "elastictk":
        causes = [s.root_cause or "?" for s in ss]
        right = sum(f"rank {victim}'s" in c for c in causes)
        out.append(f"{label}: the job-wide restart reason named the killed rank {victim} in "
                   f"{right} of {len(ss)} launches (reasons: {'; '.join(causes)})")
    else:
        out.append(f"{label}: each agent keeps its own restart budget; {own} of "
                   f"{2 * len(ss)} other-node agents counted the failure against theirs")
    return out


def freeze_note(label: str, stopped: int, world: int, cap: float) -> str:
    return (f"{label}, victim frozen with SIGSTOP (alive, its sockets open) in its first launch: "
            f"{stopped} of {world} workers had been stopped {cap:.0f}s later, the peers waiting "
            f"in all_reduce for gloo's timeout (30 min by default), so that stall lasts "
            f"> {cap:.0f}s; after SIGCONT the job trained on, and the SIGKILL above followed")

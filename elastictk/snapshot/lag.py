"""How far each rank's replica lags behind its newest commit, as a metric and a line.

The agent ships a rank's newest sealed slot, pinned while it is sent (:meth:`.local.Region.pin`),
so a send slower than the steps delivers a whole part, one send behind: the replica lags by the
steps one send takes. That lag is what a lost node costs (its ranks restore the replica's step),
so it is exported (``elastictk_snapshot_replica_lag_steps``, per rank) and said in one line when
it passes :data:`LAG_LINE` steps, again each time it doubles, and once when it is back within.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional

log = logging.getLogger("elastictk.snapshot")
LAG_LINE = 8  # steps: past this a lost node costs more than a few steps; say so


def next_report(reported: int, lag: int, bound: int = LAG_LINE) -> tuple[int, Optional[str]]:
    """The lag last said (0: within the bound) and the lag now -> what is said now (pure):
    ``"over"`` when the lag first passes ``bound`` or doubles past what was said, ``"back"``
    when it is within ``bound`` again after being over it, else None; and the new ``reported``."""
    if lag > bound and (reported == 0 or lag >= 2 * reported):
        return lag, "over"
    if lag <= bound and reported:
        return 0, "back"
    return reported, None


@dataclass
class RankLag:
    rank: int
    newest: int = -1  # the newest sealed step of this rank
    replicated: int = -1  # the newest step every ring neighbour kept whole
    reported: int = 0
    send_s: float = 0.0  # how long the last whole send took
    first: int = -1  # the first step sealed this round: none of its steps before it are owed

    @property
    def lag(self) -> int:
        """Steps sealed this round that no neighbour holds yet: counted from the round's first
        sealed step until a send arrives (a job resumed at step 100 lags 1 step, not 101)."""
        if self.newest < 0:
            return 0
        held = self.replicated if self.replicated >= 0 else self.first - 1
        return max(self.newest - held, 0)


class ReplicaLag:
    """Per local rank: newest sealed step, newest replicated step, the lag; thread-safe."""

    def __init__(self, bound: int = LAG_LINE) -> None:
        self.bound = bound
        self._lock = threading.Lock()
        self._ranks: dict[int, RankLag] = {}

    def sealed(self, lr: int, rank: int, step: int) -> None:
        with self._lock:
            r = self._ranks.setdefault(lr, RankLag(rank))
            if r.rank != rank:  # another rank in this slot: its own count
                r = self._ranks[lr] = RankLag(rank)
            r.newest = max(r.newest, step)
            if r.first < 0 or step < r.first:
                r.first = step
        self._say(lr)

    def replicated(self, lr: int, step: int, seconds: float) -> None:
        with self._lock:
            r = self._ranks.get(lr)
            if r is None:
                return
            r.replicated, r.send_s = max(r.replicated, step), seconds
        self._say(lr)

    def reset(self) -> None:
        """A new round: new neighbours hold nothing of this node yet; the counts start again."""
        with self._lock:
            self._ranks.clear()

    def lags(self) -> dict[int, int]:
        """rank -> steps its replica lags."""
        with self._lock:
            return {r.rank: r.lag for r in self._ranks.values()}

    def _say(self, lr: int) -> None:
        with self._lock:
            r = self._ranks[lr]
            r.reported, what = next_report(r.reported, r.lag, self.bound)
            lag, rank, newest, replicated, send_s = r.lag, r.rank, r.newest, r.replicated, r.send_s
        if what == "over":
            log.warning("snapshot peer tier: rank %d's replica lags %d steps behind its newest commit "
                        "(step %d; the peers hold step %s; one send took %.2f s): a lost node would "
                        "resume %d steps back; commit less often or give the replicas a faster network",
                        rank, lag, newest, replicated if replicated >= 0 else "none", send_s, lag)
        elif what == "back":
            log.info("snapshot peer tier: rank %d's replica is within %d steps of its newest commit again "
                     "(step %d)", rank, self.bound, newest)


class LagCollector:
    """``elastictk_snapshot_replica_lag_steps{rank}`` for a Prometheus registry, read at scrape."""

    def __init__(self, lag: ReplicaLag) -> None:
        self._lag = lag

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        g = GaugeMetricFamily("elastictk_snapshot_replica_lag_steps",
                              "Steps by which this node's ranks' peer replicas lag behind their newest "
                              "commit (what a lost node would redo).", labels=["rank"])
        for rank, lag in sorted(self._lag.lags().items()):
            g.add_metric([str(rank)], lag)
        yield g

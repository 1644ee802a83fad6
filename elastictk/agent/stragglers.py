"""Stragglers: the rank the others wait for, named by the round's leader.

In synchronous training every rank's step takes the same wall time (the collectives wait for
the slowest), so step intervals name nobody. What differs is where the time goes: the slow
rank spends its step on its own work (data, forward, backward, a stall) and is hardly ever
blocked, while its peers sit inside the collectives waiting for it. Each worker reports, in its
slot of the steps block, the time it spends inside ``torch.distributed`` calls made from Python
and, per step, its *own* time: the step's duration less that blocked time
(``elastictk/metrics/worker.py``, words in ``elastictk/metrics/layout.py``).

- Every agent, every ``interval`` seconds, turns its slots into one window per local rank
  (own seconds per step over the window) and writes ONE sealed record for its node,
  ``straggle/<node_id>`` in the round's store: O(nodes) store operations per interval,
  nothing per step.
- The leader (group rank 0) reads every member's record (O(nodes) reads per interval) and
  scores each rank: its own time per step against the median of the *other* ranks' (the
  others' median: with two ranks, the group median would sit halfway to the straggler). A
  rank is past the threshold in a window when it is ``threshold`` times slower than that
  median and the group lost at least ``MIN_SHARE`` of the window waiting for it (so
  microsecond noise in a loop that does almost nothing is no straggler). Past the
  threshold for ``windows`` windows in a row, it is flagged, once per streak: a ``straggler``
  event, a log line naming rank, host and how much slower, the gauge.
- Under ``--straggler-action exclude`` the leader also writes the sealed exclusion record of
  the flagged rank's node (``exclude/<node_id>``, :mod:`.exclusion`), unless the others would
  be fewer than ``--nnodes`` MIN; every node reads its own record once per interval, after
  publishing, and the agent takes it out for the cooldown (:mod:`.excluded`).

Why own time per step is averaged over the window, not a median over its steps: a pause (a
``slow:<s>`` fault, a stalled read) costs the group exactly its length, whichever step it lands
in; a median over steps would hide it. The median that makes the score robust is across ranks.

DDP: its gradient all-reduces run in C++ inside ``backward()``, so once a DDP module has run a
forward in a worker, the whole of ``torch.autograd.backward`` counts as blocked there
(``elastictk/metrics/worker.py``): a rank slow before backward (data, forward, a stall, a
``slow:<s>`` fault) is named, one slow inside backward's own compute is not.
"""
from __future__ import annotations

import logging
import socket
import statistics
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

from ..metrics.kinds import Emit, EventKind
from ..metrics.layout import SlotSnapshot
from ..metrics.steps import WorkerStepsBlock
from ..rendezvous import RendezvousStateError, RoundInfo
from ..rendezvous.sealed import Records
from ..store import StoreError
from . import exclusion

log = logging.getLogger("elastictk.agent")

ACTIONS = ("off", "report", "exclude")
MIN_SHARE = 0.05  # the group must lose at least this share of a window waiting for the rank
FLOOR = 1e-3  # seconds: the others' own time per step is taken as at least this
MAX_RANKS = 65536  # a record naming more ranks is ignored (records size nothing beyond this)


def key(node_id: str) -> str:
    return f"straggle/{node_id}"


@dataclass(frozen=True)
class RankWindow:
    """One rank over one window: its timed steps and their own (not blocked) seconds."""

    rank: int
    steps: int
    busy: float
    host: str = ""
    node: str = ""

    @property
    def per_step(self) -> float:
        return self.busy / self.steps if self.steps > 0 else 0.0


@dataclass(frozen=True)
class Score:
    """A rank's window against the others: ``slowdown`` times their median own time per step;
    ``share``: the part of the window the group spent waiting for it."""

    rank: int
    host: str
    node: str
    per_step: float
    median: float
    slowdown: float
    share: float
    past: bool


#: ``threshold`` times slower means at least that, up to rounding: a quotient of sums of floats
#: lands a few ulps below an exact ratio (hypothesis found 5.0625x judged not past 5.0625).
REL_EPS = 1e-9


def score_window(ranks: Sequence[RankWindow], window_s: float, threshold: float,
                 min_share: float = MIN_SHARE) -> list[Score]:
    """Score every rank that stepped in the window against the median of the others (pure).

    Fewer than two ranks with steps: nothing to compare, no scores.
    """
    live = [r for r in ranks if r.steps > 0]
    if len(live) < 2 or window_s <= 0:
        return []
    out = []
    for i, r in enumerate(live):
        median = statistics.median(o.per_step for j, o in enumerate(live) if j != i)
        slowdown = r.per_step / max(median, FLOOR)
        share = max(0.0, (r.per_step - median) * r.steps / window_s)
        out.append(Score(r.rank, r.host, r.node, r.per_step, median, slowdown, share,
                         slowdown >= threshold * (1 - REL_EPS) and share >= min_share))
    return out


class Flagger:
    """Consecutive windows past the threshold, per rank (pure state): :meth:`feed` returns the
    scores of the ranks whose streak just reached ``windows``; a rank is flagged again only
    after a window in which it was not past. A rank absent from a window keeps its streak."""

    def __init__(self, windows: int) -> None:
        if windows < 1:
            raise ValueError(f"straggler windows {windows!r}: need at least 1")
        self.windows = windows
        self.streak: dict[int, int] = {}

    def feed(self, scores: Sequence[Score]) -> list[Score]:
        flagged = []
        for s in scores:
            n = self.streak.get(s.rank, 0) + 1 if s.past else 0
            self.streak[s.rank] = n
            if n == self.windows:
                flagged.append(s)
        return flagged


@dataclass(frozen=True)
class StragglerSettings:
    """``--straggler-action``/``-threshold``/``-windows``/``-interval``; validated on creation."""

    action: str = "off"
    threshold: float = 1.5
    windows: int = 3
    interval: float = 5.0

    def __post_init__(self) -> None:
        check_settings(self.action, self.threshold, self.windows, self.interval)

    @property
    def on(self) -> bool:
        return self.action != "off"


def check_settings(action: str, threshold: float, windows: int, interval: float) -> None:
    """ValueError naming the setting for a value that cannot work."""
    if action not in ACTIONS:
        raise ValueError(f"--straggler-action {action!r}: use one of {', '.join(ACTIONS)}")
    if not threshold > 1:
        raise ValueError(f"--straggler-threshold {threshold!r}: must be more than 1 (times slower "
                         "than the others' median), e.g. 1.5")
    if not isinstance(windows, int) or windows < 1:
        raise ValueError(f"--straggler-windows {windows!r}: must be a whole number >= 1")
    if not interval > 0:
        raise ValueError(f"--straggler-interval {interval!r}: must be more than 0 seconds")


class _Local:
    """This node's slots turned into windows: deltas between two snapshots of the block."""

    def __init__(self, block: WorkerStepsBlock, ranks: Mapping[int, int]) -> None:
        self.block, self.ranks = block, dict(ranks)
        self.prev: dict[int, SlotSnapshot] = {s.local_rank: s for s in block.snapshot()}

    def window(self) -> list[list[Any]]:
        """``[rank, steps, busy]`` per local rank that stepped since the last call, skipping a
        slot whose process changed meanwhile (a window across a restart means nothing)."""
        out: list[list[Any]] = []
        for s in self.block.snapshot():
            p, self.prev[s.local_rank] = self.prev.get(s.local_rank), s
            rank = self.ranks.get(s.local_rank)
            if p is None or rank is None or p.owner != s.owner:
                continue
            steps, busy = s.busy_steps - p.busy_steps, s.busy_seconds - p.busy_seconds
            if steps > 0 and busy >= 0:
                out.append([rank, steps, round(busy, 6)])
        return out


class StragglerWatch:
    """One round's straggler watch on a thread: publish this node's windows, and (on the
    leader) score the group's. :meth:`stop` returns at once."""

    def __init__(self, block: WorkerStepsBlock, ranks: Mapping[int, int], records: Records, *,
                 node_id: str, members: Sequence[str], leader: bool, interval: float,
                 threshold: float, windows: int, emit: Emit | Callable[..., None],
                 exclude: "Exclude | None" = None) -> None:
        self.records, self.node_id, self.members = records, node_id, tuple(members)
        self.leader, self.interval, self.threshold = leader, float(interval), float(threshold)
        self.host = socket.gethostname()
        self.flagger = Flagger(windows)
        self._emit = emit
        self.exclude = exclude
        self._excluded: set[str] = set()  # nodes this leader wrote a record for in the round
        self._local = _Local(block, ranks)
        self._seq = 0
        self._seen: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastictk-stragglers", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._publish()
                if self.exclude is not None:
                    self._read_own()
                if self.leader:
                    self._score()
            except StoreError as e:  # the round is ending; the agent sees the store itself
                log.debug("straggler watch: %s", e)
            except Exception:  # noqa: BLE001 - never let a metric stop training
                log.warning("straggler watch failed", exc_info=True)
                return

    def _read_own(self) -> None:
        """This node's exclusion record, if the leader wrote one; garbage (no token) is
        ignored with a warning, never a reason to stop watching."""
        assert self.exclude is not None
        name = exclusion.key(self.node_id)
        try:
            body = self.records.read(name)
        except RendezvousStateError as e:
            self.records.ignored(name, str(e))
            return
        self.exclude.on_record(self.node_id, body)

    def _publish(self) -> None:
        self._seq += 1
        self.records.write(key(self.node_id), {"seq": self._seq, "host": self.host, "node": self.node_id,
                                               "window_s": self.interval, "ranks": self._local.window()})

    def _score(self) -> None:
        windows: list[RankWindow] = []
        for node in self.members:
            try:
                rec = self.records.read(key(node))
            except RendezvousStateError as e:  # garbage (no token): ignored, never the end of the watch
                self.records.ignored(key(node), str(e))
                continue
            if rec is None:
                continue
            seq = rec.get("seq")
            if not isinstance(seq, int) or seq <= self._seen.get(node, 0):
                continue  # nothing new from this node since the last look
            self._seen[node] = seq
            windows += parse_ranks(rec.get("ranks"), str(rec.get("host", "")), node)
        for s in self.flagger.feed(score_window(windows, self.interval, self.threshold)):
            self.report(s)

    def report(self, s: Score) -> None:
        log.warning("straggler: rank %d on host %s (node %s) is %.1fx slower than the others' median "
                    "(%.3fs of own time per step vs %.3fs; the group waited %.0f%% of the last window "
                    "for it) for %d windows of %gs", s.rank, s.host, s.node, s.slowdown, s.per_step,
                    s.median, 100 * s.share, self.flagger.windows, self.interval)
        self._emit(EventKind.STRAGGLER, rank=s.rank, host=s.host, straggler_node=s.node,
                   slowdown=round(s.slowdown, 3), own_s=round(s.per_step, 6), median_s=round(s.median, 6),
                   share=round(s.share, 4), windows=self.flagger.windows, window_s=self.interval)
        if self.exclude is not None and s.node and s.node not in self._excluded:
            self._exclude(s)

    def _exclude(self, s: Score) -> None:
        """Write the flagged node's sealed exclusion record (the node reads it and leaves)."""
        assert self.exclude is not None
        if len(self.members) - 1 < self.exclude.min_nodes:
            log.warning("straggler node %s is not excluded: the others (%d) would be fewer than --nnodes "
                        "MIN %d", s.node, len(self.members) - 1, self.exclude.min_nodes)
            return
        if s.node not in self.members:
            return  # a record naming a node outside the round: nothing to exclude
        self._excluded.add(s.node)
        detail = (f"rank {s.rank} on host {s.host or '?'} was {s.slowdown:.1f}x slower than the others' "
                  f"median for {self.flagger.windows} windows of {self.interval:g}s (--straggler-action exclude)")
        self.records.write(exclusion.key(s.node), exclusion.Exclusion(
            s.node, "straggler", detail, self.exclude.cooldown, by=self.node_id).to_json())


class Exclude(Protocol):
    """What the watch needs of the agent's exclusions (``excluded.ExclusionGate``)."""

    min_nodes: int

    @property
    def cooldown(self) -> float: ...

    def on_record(self, node_id: str, body: dict[str, Any] | None) -> bool: ...


def watch_round(settings: StragglerSettings | None, block: WorkerStepsBlock | None, base_rank: int,
                records: Records, node_id: str, info: RoundInfo, emit: Emit,
                exclude: Exclude | None = None) -> StragglerWatch | None:
    """The watch for one round (None when off): this node's local rank ``i`` is global rank
    ``base_rank + i``; the leader is group rank 0. ``exclude`` is used under
    ``--straggler-action exclude``."""
    if settings is None or not settings.on or block is None:
        return None
    # The member list is O(nodes) to read: only the leader, which scores every member, reads it.
    return StragglerWatch(block, {i: base_rank + i for i in range(block.n_workers)}, records,
                          node_id=node_id, members=[m.node_id for m in info.members] if info.rank == 0 else (),
                          leader=info.rank == 0, interval=settings.interval,
                          threshold=settings.threshold, windows=settings.windows, emit=emit,
                          exclude=exclude if settings.action == "exclude" else None)


def parse_ranks(raw: Any, host: str, node: str) -> list[RankWindow]:
    """The ``ranks`` of a record as windows; malformed entries are dropped."""
    out: list[RankWindow] = []
    if not isinstance(raw, list):
        return out
    for item in raw[:MAX_RANKS]:
        if (isinstance(item, list) and len(item) == 3 and isinstance(item[0], int)
                and isinstance(item[1], int) and isinstance(item[2], (int, float))
                and item[1] > 0 and item[2] >= 0):
            out.append(RankWindow(item[0], item[1], float(item[2]), host, node))
    return out


__all__ = ["ACTIONS", "Exclude", "Flagger", "RankWindow", "Score", "StragglerSettings", "StragglerWatch",
           "check_settings", "parse_ranks", "score_window", "watch_round"]

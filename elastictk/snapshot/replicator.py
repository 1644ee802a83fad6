"""The peer tier's replicator: which steps an agent ships, and how each stays whole while it does.

Every agent ships the same steps: the multiples of the job's cadence K (:mod:`.cadence`; 1,
every step, while sends are quick; raised for the whole job when a send takes longer than half
of K steps). A slot holding such a step is pinned as soon as it is sealed and stays pinned until
the next one is: the worker's commits go to its other slot meanwhile, so the part arrives whole
however long the send takes, and the step stays in this node's memory until the next shipped
one replaces it, the step its neighbour's replica of it most likely holds. A node whose targets
all kept its parts of a step says so in the round's store; receivers keep a rank's previous
replica until every node's part of the new step is whole (:meth:`.replicas.Replicas.settle`).
Once the job stops committing (an eval, its end) the newest commit ships off the cadence, so
the peers do not stay a cadence behind while nothing happens.

It is a thread of its own, apart from the round's set-up and the restore-time fetch
(:mod:`.peertier`), because a send may take many steps and the workers must never wait for one:
a round's start only re-aims it (:meth:`Replicator.aim`) and holds it off the local slots while
it fetches into them (:meth:`Replicator.resume` lets it go); everything else it decides alone,
woken by the workers' pipe.
"""
from __future__ import annotations

import logging
import os
import select
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .cadence import READ_EVERY, RoundKeys, StepClock, covering
from .lag import ReplicaLag
from .local import READY, Region, SlotMeta
from .peer import PeerClient
from .replicas import Replicas
from .settings import ENV_NOTIFY
from .wire import WireError

log = logging.getLogger("elastictk.snapshot")
Endpoint = tuple[str, str, int]  # node id, address, port
AT_REST = 1.0  # seconds without a seal (at least) before the newest commit ships off the cadence


@dataclass
class _Shipping:
    """The replicator's state for one local rank in one round."""

    pinned: Optional[SlotMeta] = None  # the slot pinned: the step chosen last, kept whole here
    chosen: int = 0  # the newest step chosen this round; the next one shipped is a multiple of K above it
    sent: int = -1  # the newest step whose send was tried


@dataclass
class _Cycle:
    """One step's sends, over the local ranks."""

    tried: set[int] = field(default_factory=set)
    whole: set[int] = field(default_factory=set)
    seconds: float = 0.0


class Replicator:
    """The thread that ships this node's parts to its ring targets; ``stop()`` ends it and its
    connections, ``close()`` its pipes."""

    def __init__(self, regions: list[Region], replicas: Replicas, lag: ReplicaLag,
                 connect: Callable[[Endpoint], PeerClient], warn: Callable[[str, str], None],
                 rate: float) -> None:
        """``connect``: a new connection for puts to an endpoint; ``warn(cause, line)``: said once
        per cause; ``rate``: bytes/s at most, 0 for no limit."""
        self.regions, self.replicas, self.lag = regions, replicas, lag
        self._connect, self._warn = connect, warn
        self.rate = rate  # tests slow the sends down (bytes/s); 0 in a job
        self._rfd, self._wfd = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._node_id = ""
        self._targets: list[Endpoint] = []
        self._clients: dict[Endpoint, PeerClient] = {}
        self._gen = 0  # the round; the replicator starts over when it changes
        self._paused = False  # a round's start is fetching into the regions: nothing is pinned
        self._floors: list[int] = [0] * len(regions)  # per region: the newest seq when the round began
        self._keys: Optional[RoundKeys] = None  # the round's cadence and whole-step keys
        self._retired: list[RoundKeys] = []  # earlier rounds' keys, closed by the replicator
        self.cadence = 1  # the job's cadence as this agent last knew it (this round)
        # The replicator thread's own (one round's):
        self._seen = -1
        self._ranks: dict[int, _Shipping] = {}
        self._cycles: dict[int, _Cycle] = {}
        self._clock = StepClock()
        self._read_at = 0.0
        self._read_for: Optional[int] = None  # the step the cadence was last read before choosing
        self._sealed: tuple[tuple[int, int], float] = ((0, 0), 0.0)  # (newest seq, regions), when seen
        self._unshipped = False  # a newer step than the one pinned is sealed (it ships at rest)
        self._thread = threading.Thread(target=self._run, name="elastictk-replicator", daemon=True)
        self._thread.start()

    def env(self) -> dict[str, str]:
        """Where the workers say they sealed a slot: this agent's end of the pipe that wakes it."""
        return {ENV_NOTIFY: f"/proc/{os.getpid()}/fd/{self._wfd}"}

    def holding(self) -> bool:
        """Whether a replaced replica waits for its newer step to be whole everywhere: from K=2
        on, when the round's store says so (at K=1 a send takes under half a step)."""
        return self._keys is not None and self.cadence >= 2

    # -- rounds -----------------------------------------------------------------------------------
    def aim(self, node_id: str, targets: list[Endpoint], keys: Optional[RoundKeys], paused: bool) -> None:
        """A round begins: ship to ``targets`` from now on (closing the connections to others),
        with the round's ``keys``; ``paused``: pin nothing until :meth:`resume` (the round's start
        fetches into the regions). Every region is unpinned: the fetches and the workers'
        restore may use either slot."""
        with self._lock:
            self._gen += 1
            self._paused = paused
            self._node_id, self._targets = node_id, targets
            for e in [e for e in self._clients if e not in targets]:
                self._clients.pop(e).close()
            if self._keys is not None:
                self._retired.append(self._keys)
            self._keys = keys
            self.lag.reset()
        for r in self.regions:
            r.unpin()

    def resume(self) -> None:
        """The round's start is done with the regions: only what is sealed from now on ships, not
        a step the workers' restore gives up."""
        with self._lock:
            self._floors = [max(r.meta(0).seq, r.meta(1).seq) for r in self.regions]
            self._paused = False
        self.poke()

    # -- the thread -------------------------------------------------------------------------------
    def poke(self) -> None:
        try:
            os.write(self._wfd, b"\0")
        except BlockingIOError:
            pass

    def _run(self) -> None:
        while True:  # woken per seal, per kept replica, per round; once a second while one waits
            waits = [READ_EVERY] if self._keys is not None and self.replicas.waiting() else []
            if self._unshipped:
                waits.append(max(self._sealed[1] + self._at_rest() - time.monotonic(), 0.01))
            ready, _, _ = select.select([self._rfd, self._stop_r], [], [], min(waits, default=None))
            if self._stop_r in ready:
                return
            try:
                while os.read(self._rfd, 4096):
                    pass
            except BlockingIOError:
                pass
            self._work()

    def _work(self) -> None:
        """Pin newly sealed steps of the cadence, send what is pinned and not sent yet, one part
        at a time (pinning again between parts), and settle the replicas held for a whole step."""
        with self._lock:
            gen, targets, node_id, keys = self._gen, list(self._targets), self._node_id, self._keys
            retired, self._retired = self._retired, []
        for k in retired:
            k.close()
        if gen != self._seen:  # a new round: new neighbours get the newest parts again
            self._seen, self.cadence, self._read_at, self._read_for = gen, 1, 0.0, None
            self._sealed, self._unshipped = ((0, 0), time.monotonic()), False
            self._ranks = {lr: _Shipping() for lr in range(len(self.regions))}
            self._cycles.clear()
            self._clock = StepClock()
            self._read_cadence(keys)
        self._settle(keys)
        while self._pin(gen, keys) and targets:
            due = [(lr, st.pinned) for lr, st in sorted(self._ranks.items())
                   if st.pinned is not None and st.sent < st.pinned.step]
            if not due:
                return
            lr, m = due[0]
            assert m is not None
            self._send(lr, m, targets, node_id, keys)
            self._settle(keys)

    def _pin(self, gen: int, keys: Optional[RoundKeys]) -> bool:
        """Pin each local rank's newest sealed step that is a multiple of the cadence and newer
        than the one it holds (with K=1: its newest); False once a new round has begun."""
        k = self.cadence
        now = time.monotonic()
        sealed = [max((m.seq for m in (r.meta(0), r.meta(1)) if m.state == READY and m.checked), default=0)
                  for r in self.regions]
        mark = (max(sealed, default=0), sum(sealed))
        if mark != self._sealed[0]:
            self._sealed = (mark, now)
        at_rest = k > 1 and now - self._sealed[1] >= self._at_rest()  # an eval, the job's end
        self._unshipped = False
        for lr, region in enumerate(self.regions):
            st = self._ranks[lr]
            metas = [m for m in (region.meta(0), region.meta(1))
                     if m.state == READY and m.checked and 0 < m.length <= region.slot_size]
            if st.pinned is not None and not any((m.index, m.seq) == (st.pinned.index, st.pinned.seq) for m in metas):
                with self._lock:  # given up by a restore, then written anew: no longer ours to hold
                    if self._gen == gen and region.pinned == st.pinned.index:
                        region.unpin()
                st.pinned = None
            if not metas:
                continue
            newest = max(metas, key=lambda m: m.seq)
            self.lag.sealed(lr, newest.rank, newest.step)
            self._clock.saw(newest.step)
            with self._lock:
                floor = self._floors[lr]
            due = [m for m in metas if (m.step % k == 0 or (at_rest and m is newest)) and m.step > st.chosen
                   and m.seq > floor and (st.pinned is None or m.seq > st.pinned.seq)]
            if not due and k > 1 and newest.step > st.chosen and newest.seq > floor:
                self._unshipped = True
            if due and keys is not None and self._read_cadence(keys, before=max(m.step for m in due)) != k:
                k = self.cadence  # read before choosing: another agent raised it
                due = [m for m in due if m.step % k == 0 or (at_rest and m is newest)]
            if due:
                m = max(due, key=lambda m: m.seq)
                with self._lock:
                    if self._gen != gen or self._paused:
                        return False
                    pinned = region.pin(m)
                    if not pinned and st.pinned is not None:
                        region.pin(st.pinned)  # the older step stays whole here
                if pinned:
                    st.pinned, st.chosen = m, m.step
                    continue
                self._missed(st, m.rank, m.step, k)
            elif k > 1 and newest.step >= (st.chosen // k + 1) * k:  # sealed and overwritten unseen
                self._missed(st, newest.rank, newest.step // k * k, k)
        with self._lock:
            return self._gen == gen and not self._paused

    def _at_rest(self) -> float:
        """Seconds without a new seal after which the newest commit ships, whatever its step:
        four steps' time, at least :data:`AT_REST` (the job paused for an eval, or ended; every
        rank stopped at the same step, so every node ships the same one)."""
        per_step = self._clock.step_seconds()
        return max(AT_REST, 4 * per_step) if per_step else AT_REST

    def _observe(self) -> None:
        """The newest step sealed now, for the step clock."""
        newest = [m for r in self.regions for m in (r.meta(0), r.meta(1)) if m.state == READY and m.checked]
        if newest:
            self._clock.saw(max(newest, key=lambda m: m.seq).step)

    def _missed(self, st: _Shipping, rank: int, step: int, k: int) -> None:
        st.chosen = max(st.chosen, step)
        self._warn("missed", f"rank {rank}'s step {step} was overwritten before this agent could pin it "
                   f"(the job ships every {_nth(k)} step); this node skips it, so a node lost before its "
                   "next shipped step restores an older one (said once)")

    def _send(self, lr: int, m: SlotMeta, targets: list[Endpoint], node_id: str,
              keys: Optional[RoundKeys]) -> None:
        """Send pinned slot ``m`` of local rank ``lr`` to every target; the pin stays (the step
        stays whole here until the next one is pinned)."""
        st, region = self._ranks[lr], self.regions[lr]
        st.sent = m.step
        t0 = time.monotonic()
        kept = [self._put(e, node_id, region, m) for e in targets]
        took = time.monotonic() - t0
        now = [x for x in (region.meta(0), region.meta(1)) if x.state == READY and x.checked]
        if now:  # what was sealed meanwhile: the lag once the part arrived is the send's steps
            newest = max(now, key=lambda x: x.seq)
            self.lag.sealed(lr, newest.rank, newest.step)
        cycle = self._cycles.setdefault(m.step, _Cycle())
        cycle.tried.add(lr)
        cycle.seconds += took
        if all(kept):
            cycle.whole.add(lr)
            self.lag.replicated(lr, m.step, took)
        if len(cycle.tried) == len(self.regions):  # every local rank's part of this step sent
            self._observe()  # the steps sealed meanwhile: what the send cost in steps
            del self._cycles[m.step]
            for s in [s for s in self._cycles if s < m.step]:
                del self._cycles[s]
            self._raise(m.step, cycle.seconds, keys)
            if len(cycle.whole) == len(self.regions) and keys is not None and self.cadence >= 2:
                keys.mark_whole(m.step)
        self._read_cadence(keys)

    def _raise(self, step: int, seconds: float, keys: Optional[RoundKeys]) -> None:
        """A send that took more than half of K steps raises the job's cadence (:func:`covering`)."""
        per_step = self._clock.step_seconds()
        if not per_step:
            return
        steps = seconds / per_step
        k = covering(steps, self.cadence)
        if k <= self.cadence:
            return
        was = self.cadence
        stored = keys.raise_to(k) if keys is not None else None
        self.cadence = max(k, stored or 0)
        log.info("snapshot peer tier: sending step %d took %.2f s, %.1f steps of %.3f s: the job now ships "
                 "every %s step (was every %s), so every node ships the same steps and a lost node's "
                 "replica step is one the others hold too", step, seconds, steps, per_step,
                 _nth(self.cadence), _nth(was))

    def _read_cadence(self, keys: Optional[RoundKeys], before: Optional[int] = None) -> int:
        """The job's cadence, read before step ``before`` is chosen (once per step, whatever the
        local ranks) and after each send; at most every :data:`READ_EVERY` seconds while it is 1
        (a send every step)."""
        now = time.monotonic()
        fresh = before is not None and before != self._read_for and self.cadence > 1
        if keys is None or (now - self._read_at < READ_EVERY and not fresh):
            return self.cadence
        self._read_at, self._read_for = now, before if before is not None else self._read_for
        k = keys.cadence()
        if k is not None and k > self.cadence:
            log.info("snapshot peer tier: the job ships every %s step now (was every %s)", _nth(k),
                     _nth(self.cadence))
            self.cadence = k
        return self.cadence

    def _settle(self, keys: Optional[RoundKeys]) -> None:
        """Replicas held beside a newer one go once the newer step is whole everywhere (asked in
        the round's store once per step and wake-up; those of an earlier round wait for the
        rank's next part or the round after, as any replica of a node gone)."""
        if keys is not None and self.cadence >= 2 and self.replicas.waiting():
            self.replicas.settle(keys.whole)

    def _put(self, e: Endpoint, node_id: str, region: Region, m: Any) -> bool:
        """Send pinned slot ``m`` to ``e``; whether ``e`` kept it."""
        try:
            if self.rate and select.select([self._stop_r], [], [], m.length / self.rate)[0]:
                return False  # closing
            for _ in range(2):
                c = self._clients.get(e)
                pooled = c is not None
                if c is None:
                    c = self._clients[e] = self._connect(e)
                try:
                    c.put(node_id, m.rank, m.world, m.step, m.digest, region.data(m.index)[:m.length])
                    return True
                except (WireError, OSError) as err:
                    if not pooled or (isinstance(err, WireError) and "after 0 of" not in str(err)):
                        raise
                    self._drop_client(e)  # the server closed it while it sat idle: once more, anew
            return False
        except WireError as err:
            self._warn(f"put {e[1]} {type(err).__name__}", f"rank {m.rank}'s step {m.step} not "
                       f"replicated to {e[1]}: {err}")
            if "refused" not in str(err) and "did not keep" not in str(err):
                self._drop_client(e)
        except OSError as err:
            self._warn(f"put {e[1]} os", f"cannot replicate to {e[1]}:{e[2]}: {err}")
            self._drop_client(e)
        return False

    def _drop_client(self, e: Endpoint) -> None:
        with self._lock:
            c = self._clients.pop(e, None)
        if c is not None:
            c.close()

    def stop(self) -> None:
        """End the thread, the round's keys and the connections (the pipes stay for
        :meth:`close`: the replica server's kept-callback may still poke it until it is closed)."""
        os.write(self._stop_w, b"\0")
        self._thread.join(timeout=30)
        for k in [*self._retired, *([self._keys] if self._keys is not None else [])]:
            k.close()
        self._retired, self._keys = [], None
        for c in list(self._clients.values()):
            c.close()
        self._clients.clear()

    def close(self) -> None:
        """Close the pipes, once :meth:`stop` has ended the thread and nothing pokes it."""
        for fd in (self._rfd, self._wfd, self._stop_r, self._stop_w):
            os.close(fd)


def _nth(k: int) -> str:
    """``1`` -> ``"1st"`` as in "every 32nd step"; 1 reads "single"."""
    if k == 1:
        return "single"
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"

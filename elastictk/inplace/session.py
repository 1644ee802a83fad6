"""One worker's link to the agent's generations: form the newest, sync the state, tell the
agent what went wrong, leave at a commit point (``run_elastic`` drives it; see ``loop``).

The worker side of ``protocol``: it finds the newest generation by reading the sealed
records, forms that generation's gloo/NCCL group under its own store prefix, and brings every
rank to the newest commit any rank holds (a broadcast from its holder; the ranks restore from
the snapshot tiers together when nobody holds one).
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .protocol import (
    ENV_FIRST_GEN, ENV_KEY, ENV_NODE, ENV_PREFIX, ENV_STORE, Generation, Sealer, error_key, gen_key,
    is_peer_failure, joined_key, newest, pg_prefix, ready_key, ready_value, shard,
)
from .state import State

ENV_WAIT = "ELASTICTK_INPLACE_WAIT"  # how long a survivor waits for the next generation
DEFAULT_WAIT = 300.0
JOIN_TIMEOUT = 120.0
CHECK_EVERY = 0.05  # seconds between looks for a newer generation (nodes joining) between steps


class RecoveryError(RuntimeError):
    """In-place recovery could not continue (no next generation in time, nobody holds state);
    the worker exits and the agent falls back to restarting the whole group."""


@dataclass(frozen=True)
class Context:
    """Where this worker stands in the current generation."""

    rank: int
    world_size: int
    generation: int = 0
    restart_count: int = 0
    recovered: bool = False  # this generation was formed after a failure

    def shard(self, global_size: int) -> range:
        """This rank's contiguous part of global indices ``[0, global_size)``."""
        return shard(global_size, self.rank, self.world_size)


def _drop(holder: list[Any]) -> None:
    holder.clear()  # the last reference: the destructor runs here


def _set_timeout(seconds: float) -> None:
    """The default group's collective timeout (private in torch; without it the forming
    timeout stays, which only makes a hang take longer to detect)."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is not None:
        try:
            setter(datetime.timedelta(seconds=seconds))
        except (RuntimeError, TypeError, ValueError):
            pass


def say(line: str) -> None:
    """One line to stderr in one write: under ``python -u`` semantics ``print`` writes the
    text and its newline separately, and the agent's own lines land in between."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


class Session:
    """This worker's link to the agent's generations (or, without one, a plain process group)."""

    def __init__(self, backend: str, timeout: float, rank: int, world_size: int,
                 store: Optional[Any], node: str = "", local_rank: int = 0,
                 first_gen: int = 0, key: Optional[str] = None, prefix: str = "") -> None:
        self.backend = backend
        self.timeout = timeout
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.node = node
        self.local_rank = local_rank
        self.first_gen = first_gen
        # Token jobs: the records of the in-place store are sealed with the run's in-place key
        # (``prefix``: the store's, which the MACs cover); one that does not verify is absent.
        self.sealer = Sealer(key, prefix)
        self.wait_s = float(os.environ.get(ENV_WAIT, DEFAULT_WAIT))
        self._next_check = 0.0
        self._fresh = True  # until it first joins, a worker holds only its initial state
        self._reapers: list[threading.Thread] = []

    @property
    def recoverable(self) -> bool:
        return self.store is not None

    @classmethod
    def from_env(cls, backend: str, timeout: float) -> "Session":
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        endpoint = os.environ.get(ENV_STORE)
        if not endpoint:
            return cls(backend, timeout, rank, world, None)
        host, _, port = endpoint.rpartition(":")
        raw = dist.TCPStore(host.strip("[]"), int(port), is_master=False,
                            timeout=datetime.timedelta(seconds=max(timeout, 60.0)), use_libuv=True)
        prefix = os.environ.get(ENV_PREFIX, "")
        store = dist.PrefixStore(prefix, raw)
        return cls(backend, timeout, rank, world, store, node=os.environ.get(ENV_NODE, ""),
                   local_rank=int(os.environ.get("ELASTICTK_LOCAL_RANK") or os.environ.get("LOCAL_RANK") or 0),
                   first_gen=int(os.environ.get(ENV_FIRST_GEN, "0")),
                   key=os.environ.get(ENV_KEY) or None, prefix=prefix)

    # -- forming a generation -----------------------------------------------------------------
    def join(self, state: State, after: Optional[int]) -> Context:
        """Form the newest generation's group (newer than ``after``), sync the state."""
        if self.store is None:
            dist.init_process_group(self.backend, timeout=datetime.timedelta(seconds=self.timeout))
            if not state.committed:
                state.restore()  # a restart-all: every rank starts here, the tiers hold the state
            return Context(dist.get_rank(), dist.get_world_size(),
                           restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        while True:
            gen = self._next_generation(after)
            if gen.finished:
                # Joined (or was replaced) just as the job ended: nothing left to train.
                say(f"elastictk: rank {self.rank}: the job finished at generation "
                     f"{gen.gen - 1} before this worker joined; exiting")
                raise SystemExit(0)
            rank = gen.rank_of(self.node, self.local_rank, self.rank)
            if rank is None:
                raise RecoveryError(f"rank {self.rank}: generation {gen.gen} has no place for this "
                                    f"node ({self.node or 'unnamed'}): it left the job")
            self.rank, self.world_size = rank, gen.world_size
            failed = False
            try:
                # Forming waits for a replacement to fork and start, which takes longer than a
                # healthy collective on a busy host: a long timeout to form, then the short one.
                dist.init_process_group(
                    self.backend, store=dist.PrefixStore(pg_prefix(gen.gen), self.store),
                    rank=self.rank, world_size=gen.world_size,
                    timeout=datetime.timedelta(seconds=max(self.timeout, JOIN_TIMEOUT)))
                _set_timeout(self.timeout)
                # A worker whose first generation is not the first has no state of its own.
                _sync(state, self.rank, fresh=self._fresh and gen.gen > 0)
            except RuntimeError as e:
                if not is_peer_failure(e):
                    raise
                failed = True
            if failed:
                # A peer died while the group formed: wait for the generation after this one.
                self._teardown()
                after = gen.gen
                continue
            self._fresh = False
            if self.store.add(joined_key(gen.gen), 1) == gen.world_size:
                key = ready_key(gen.gen)
                self.store.set(key, self.sealer.seal(key, ready_value(time.time())))
            return Context(self.rank, gen.world_size, gen.gen, gen.restart_count,
                           recovered=after is not None)

    def _next_generation(self, after: Optional[int]) -> Generation:
        assert self.store is not None
        if after is None and self.first_gen > 0:
            after = self.first_gen - 1  # a joining node's worker: not before the round it joins
        first = after + 1 if after is not None else 0
        deadline = time.monotonic() + self.wait_s
        while True:
            self._await(first, deadline)
            # The newest from there: records are numbered without gaps, so reading them finds
            # it; bytes that do not verify end the run.
            latest = newest(self._published, first)
            value = self._open(latest)
            if value is not None:
                return Generation.from_json(value)

    def _await(self, g: int, deadline: float) -> None:
        """Until generation ``g``'s record is there (and verifies). A store wait may end before
        the key exists (torch's store wakes a waiter when anyone reads the absent key by
        compare-and-set), so presence is checked, never inferred."""
        assert self.store is not None
        key = gen_key(g)
        while not self._published(g):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RecoveryError(f"rank {self.rank}: no generation {g} within {self.wait_s:.0f}s; "
                                    "giving up on in-place recovery")
            if self.store.check([key]):
                time.sleep(0.05)  # token jobs: bytes that do not verify; the agent replaces them
                continue
            try:
                self.store.wait([key], datetime.timedelta(seconds=min(left, 1.0)))
            except RuntimeError:
                pass  # timed out: look again, until the deadline

    def _open(self, g: int) -> Optional[bytes]:
        """Generation ``g``'s record, None when absent or it does not verify."""
        assert self.store is not None
        key = gen_key(g)
        if not self.store.check([key]):
            return None
        return self.sealer.open(key, self.store.get(key))

    def _published(self, g: int) -> bool:
        """Whether generation ``g``'s record exists (and, token jobs, verifies)."""
        assert self.store is not None
        if not self.sealer.enabled:
            return bool(self.store.check([gen_key(g)]))
        return self._open(g) is not None

    def superseded(self, gen: int) -> bool:
        """Whether a generation after ``gen`` exists (nodes joined); looked up at most every
        ``CHECK_EVERY`` seconds, so a step costs one store round trip only now and then."""
        if self.store is None:
            return False
        now = time.monotonic()
        if now < self._next_check:
            return False
        self._next_check = now + CHECK_EVERY
        return self._published(gen + 1)

    def finish(self, ctx: Context) -> bool:
        """Every rank is past the last step: end the job, unless nodes joined just now.

        Rank 0 claims the next generation's record for a ``finished`` one (compare-and-set);
        when an agent published a real next generation first, the ranks go on into it (the
        state is final already; the newcomers receive it, then all finish together). Rank 0
        tells the others which it was, so every rank decides the same."""
        if self.store is None:
            return True
        flag = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            done = Generation(ctx.generation + 1, ctx.world_size, ctx.restart_count,
                              "finished", finished=True).to_json()
            key, store = gen_key(ctx.generation + 1), self.store
            won, _ = self.sealer.claim(key, done, lambda old, new: store.compare_set(key, old or "", new))
            flag[0] = int(won)
        dist.broadcast(flag, 0)
        return bool(flag[0])

    def leave(self, ctx: Context) -> None:
        """Leave the group at a commit point for the next generation (no failure to report)."""
        self._teardown()
        say(f"elastictk: rank {self.rank}: generation {ctx.generation + 1} published; "
             "re-forming at this commit")

    def report_error(self, ctx: Context, first: str) -> None:
        """Tear the group down and tell the agent (which may have to find a frozen peer)."""
        assert self.store is not None
        self._teardown()
        try:
            if self._published(ctx.generation + 1):
                # A peer left for the next generation (nodes joined or left): not a failure.
                say(f"elastictk: rank {self.rank}: generation {ctx.generation + 1} published; "
                     f"re-forming ({first})")
                return
        except RuntimeError:
            pass
        try:
            key = error_key(ctx.generation)
            self.store.set(key, self.sealer.seal(key, json.dumps(
                {"rank": self.rank, "error": first, "t": time.time()}).encode()))
        except RuntimeError:
            pass  # the store is gone with the agent; the death signal ends this worker next
        say(f"elastictk: rank {self.rank}: collective failed in generation "
             f"{ctx.generation}: {first}; recovering in place")

    def _teardown(self) -> None:
        if not dist.is_initialized():
            return
        if self.backend == "nccl":
            # Queued kernels would wait forever on a dead peer; abort the communicators first.
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                try:
                    abort()
                except RuntimeError:
                    pass
        pg = dist.distributed_c10d._get_default_group()
        try:
            dist.destroy_process_group()
        except RuntimeError:
            pass
        # The group's C++ destructor closes its connections (which is what tells a peer still
        # blocked on one of them) and then joins its threads, tens of ms. Run it off this
        # thread: the connections close as soon, and the next group forms meanwhile.
        reaper = threading.Thread(target=_drop, args=([pg],), name="elastictk-pg-teardown",
                                  daemon=True)
        del pg
        reaper.start()
        self._reapers.append(reaper)

    def close(self) -> None:
        self._teardown()
        for t in self._reapers:
            t.join(timeout=30)


def _sync(state: State, rank: int, *, fresh: bool) -> None:
    """Make every rank's state the newest commit any rank holds (broadcast from its holder).

    A fresh worker counts as step -1, so any survivor's commit wins over its initial state.
    When no rank holds a commit (the job's first start, or every worker was restarted: a
    restart-all, every worker of a generation lost at once), the ranks restore together from
    the snapshot tiers (``state.restore()``: the newest step every rank holds whole); without
    one each keeps its initial state, as at the first start.
    """
    world = dist.get_world_size()
    mine = torch.tensor([-1 if fresh or not state.committed else state.committed_step()],
                        dtype=torch.int64)
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(every, mine)
    steps = [int(t[0]) for t in every]
    best = max(steps)
    if best < 0:
        state.restore()  # collective over this group; None (keeps its state) without a tier
        return
    if min(steps) == best:
        return  # everyone is at the same commit: nothing to send
    src = steps.index(best)
    size = torch.zeros(1, dtype=torch.int64)
    payload = state.to_bytes() if rank == src else b""
    size[0] = len(payload)
    dist.broadcast(size, src)
    buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if rank == src
           else torch.empty(int(size[0]), dtype=torch.uint8))
    dist.broadcast(buf, src)
    # A rank already at the newest commit holds that state: data parallel ranks that committed
    # the same step hold the same weights. Only the ones behind pay for deserializing it.
    if steps[rank] < best:
        state.load_bytes(buf.numpy().tobytes())

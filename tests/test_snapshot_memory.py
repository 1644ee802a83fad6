"""A node's snapshot memory stays within its bound: two local slots and one replica at rest (3x
the state), and one part more from the start of an arrival until every node's part of that step
is whole (4x: the newer replica beside the one it replaces), never more.

Two agents' tiers in one process, a ring of two (each ships to the other) sharing a round store
(the cadence and the whole-step counters), both workers committing every few milliseconds while
each send is throttled to ~0.1 s, as in a job whose sends are slower than its steps (so the job's
cadence rises and every replaced replica waits for its newer step to be whole on both nodes).
Memory is counted as bytes held, not as time: each node's memfd pages written (``st_blocks``: the
local tier, which the worker maps too) plus every anonymous shared mapping of this process
(``/proc/self/maps``: the replicas, kept and arriving, each a ``/dev/zero (deleted)`` mapping),
sampled while the job commits and once at rest, when the last shipped step of each node has
arrived whole and the older replicas are gone.
"""
from __future__ import annotations

import gc
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from elastictk.snapshot.local import Holder, Region
from elastictk.snapshot.peertier import PeerTier
from elastictk.snapshot.settings import ENV_NOTIFY
from elastictk.store import FileStore

JOB, TOKEN = "memory-test", "memory-token"
PART = 1 << 20  # the state: one part per node
PAGE = 4096
SLACK = 16 * PAGE  # the region's header and slot metas, rounding


class Member:
    def __init__(self, node_id: str, rank: int, meta: dict[str, object]) -> None:
        self.node_id, self.rank, self.meta = node_id, rank, meta


def _anon_shared() -> int:
    """Bytes of this process's anonymous shared mappings (MAP_SHARED|MAP_ANONYMOUS)."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == "/dev/zero" and fields[1][3] == "s":
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                total += hi - lo
    return total


def _commit(region: Region, step: int, rank: int) -> None:
    i = region.begin()
    region.data(i)[:PART] = step.to_bytes(4, "little") * (PART // 4)
    region.publish(i, step, PART, rank, 2)
    region.seal(i)


@pytest.mark.parametrize("replica_memory, most", [(4 * PART, 4), (PART, 3)], ids=["whole-throughout", "tight"])
def test_a_node_holds_two_slots_and_one_replica_at_rest_and_one_arriving_part_more_at_most(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, replica_memory: int, most: int) -> None:
    """``tight``: ``--snapshot-replica-memory`` of one part, 3x at every instant: the kept
    replica goes before its successor arrives, said in one line."""
    caplog.set_level(logging.WARNING, "elastictk.snapshot")
    gc.collect()  # an earlier test's replicas, unreachable but still mapped, go first
    base = _anon_shared()
    holders = [Holder(1, 4 * PART) for _ in range(2)]
    tiers = [PeerTier(h, "127.0.0.1", TOKEN, JOB, 1, replica_memory) for h in holders]
    workers: list[Region] = []
    peak = {"total": 0}
    stop = threading.Event()

    def node_memory() -> int:
        """Both nodes together: local tiers written plus replicas mapped."""
        local = sum(os.stat(h.path).st_blocks * 512 for h in holders)
        return local + _anon_shared() - base

    def sample() -> None:
        while not stop.is_set():
            peak["total"] = max(peak["total"], node_memory())
            stop.wait(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        for t in tiers:
            t.rate = PART / 0.1  # each send ~0.1 s: several commits land during one
        members = [Member(f"node{i}", i, {"addr": "127.0.0.1", **tiers[i].meta()}) for i in range(2)]
        store = FileStore(tmp_path / "round", durable=False)
        for i in range(2):
            tiers[i].round(members, 2, f"node{i}", i, prefetch=False, store=store)
        workers = [Region(h.path, 0, h.region, h.memory, 1, notify=t.env()[ENV_NOTIFY])
                   for h, t in zip(holders, tiers)]
        sampler.start()
        step, deadline = 0, time.monotonic() + 120
        while min(t.server.whole for t in tiers) < 5:  # five replicas each, sent while committing
            assert time.monotonic() < deadline, [t.server.whole for t in tiers]
            step += 1
            for rank, w in enumerate(workers):
                _commit(w, step, rank)
            time.sleep(0.01)
        assert min(t.cadence for t in tiers) > 1, "sends slower than the steps raise the cadence"
        k = max(t.cadence for t in tiers)
        while step % k:  # on to a step every node ships, then at rest
            step += 1
            for rank, w in enumerate(workers):
                _commit(w, step, rank)
            time.sleep(0.01)
        while not all([x.step for x in t.replicas.index()] == [step] for t in tiers):  # older ones gone
            assert time.monotonic() < deadline, f"the last shipped step never settled: {[t.replicas.index() for t in tiers]}"
            time.sleep(0.01)
        stop.set()
        sampler.join()
        at_rest = node_memory()
        assert [t.server.torn for t in tiers] == [0, 0], "every replica arrived whole"
        per_node_peak, per_node_rest = peak["total"] / 2, at_rest / 2
        assert per_node_rest <= 3 * PART + SLACK, (
            f"at rest a node holds {per_node_rest / PART:.2f}x the state: two local slots and one "
            "replica are 3x")
        assert per_node_peak <= most * PART + SLACK, (
            f"a node held {per_node_peak / PART:.2f}x the state: two local slots, the kept replica "
            "and the newer one (arriving, or kept until it is whole on every node) are 4x; with a "
            "bound of one replica, 3x")
        tight = [r.getMessage() for r in caplog.records if "was dropped before step" in r.getMessage()]
        if most == 3:
            assert min(t.replicas.tight for t in tiers) > 0 and len(tight) == 2, tight  # once per sender
            assert "for a whole replica throughout give --snapshot-replica-memory at least 2.1 MB" in tight[0], tight
        else:
            assert tight == [] and [t.replicas.tight for t in tiers] == [0, 0]
        print(f"per node: {per_node_peak / PART:.2f}x at the peak, {per_node_rest / PART:.2f}x at rest")
    finally:
        stop.set()
        for w in workers:
            w.close()
        for t in tiers:
            t.close()
        for h in holders:
            h.close()
        if "store" in locals():
            store.close()
    assert _anon_shared() <= base, "every replica's mapping went with its tier"


def test_the_replica_bound_reaches_the_agent_only_with_the_peer_tier(tmp_path: Path) -> None:
    """``--snapshot-replica-memory`` from the command line to the agent's config (which hands it
    to the peer tier's replicas, by default the local tier's bound)."""
    from elastictk.agent import build_agent
    from elastictk.cli import parse_args

    script = tmp_path / "s.py"
    script.write_text("")
    for tiers, want in (("local,peer", 10**6), ("local", None)):
        config = parse_args(["--standalone", "--snapshot", tiers, "--snapshot-replica-memory", "1M",
                             str(script)], environ={})
        agent, handle = build_agent(config)
        try:
            assert agent.config.snapshot_replica_memory == want
            assert agent.config.snapshot_replicas == (1 if want else 0)
        finally:
            handle.close()

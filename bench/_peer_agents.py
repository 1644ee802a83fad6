"""Agents' side of ``bench snapshot``'s peer rows, in a process of its own as in a real job.

Node A owns the bench process's snapshot memory (its memfd, as ``elastictk-run --snapshot
local,peer`` does) and replicates each sealed slot to node B over the peer tier. Commands on
stdin, one JSON line answered per command on stdout:

- ``start``: make A and B; answers the environment a worker on A gets (memfd, notify pipe).
- ``fetch``: node A is lost; node C takes its rank and, as its agent does before its workers
  start, fetches the part from B; answers C's worker environment and how long the fetch took.
- ``arrivals``: how many of A's parts B kept whole and refused torn so far.
- ``quit``: close everything.
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import sys
import time
from typing import Any, Optional

from elastictk.snapshot.local import Holder
from elastictk.snapshot.peertier import PeerTier

TOKEN, JOB = "bench-token", "bench"


def _used(tier: PeerTier) -> int:
    while True:
        try:
            return tier.replicas.used()
        except RuntimeError:  # the set changed while it was summed: read again
            continue


def _rss(pid: int) -> dict[str, int]:
    """RssAnon and RssShmem of ``pid`` in bytes (0 when it is gone)."""
    out = {"rss_anon": 0, "rss_shmem": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssShmem"):
                    out["rss_" + key[3:].lower()] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


class _Member:
    def __init__(self, node_id: str, rank: int, tier: PeerTier) -> None:
        self.node_id, self.rank, self.meta = node_id, rank, {"addr": "127.0.0.1", **tier.meta()}


def _answer(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    memory = int(sys.argv[1])
    replica_memory = int(sys.argv[2]) if len(sys.argv) > 2 else memory  # --snapshot-replica-memory
    holders: list[Holder] = []
    tiers: list[PeerTier] = []
    try:
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "start":
                holders += [Holder(1, memory), Holder(1, memory)]
                tiers += [PeerTier(h, "127.0.0.1", TOKEN, JOB, 1, replica_memory) for h in holders]
                a, b = _Member("A", 1, tiers[0]), _Member("B", 0, tiers[1])
                # One process in the bench, so the parts are rank 0's of a world of 1; B is
                # group rank 0 and A group rank 1, so A's ring neighbour is B.
                tiers[0].round([b, a], 1, "A", 0, prefetch=False)
                tiers[1].round([b, a], 1, "B", 0, prefetch=False)
                _answer({**holders[0].env(), **tiers[0].env()})
            elif cmd == "mem":  # node A's local tier (pages written) and B's replicas, in bytes
                _answer({"local": os.stat(holders[0].path).st_blocks * 512 if holders else 0,
                         "replicas": _used(tiers[1]) if len(tiers) > 1 else 0, **_rss(os.getpid()),
                         "lag": max(tiers[0].lag.lags().values(), default=0) if tiers else 0})
            elif cmd == "arrivals":  # parts B received from A: kept whole, refused torn
                srv = tiers[1].server if len(tiers) > 1 else None
                _answer({"whole": srv.whole if srv else 0, "torn": srv.torn if srv else 0})
            elif cmd == "replicated":  # the step B holds newest from A
                steps = [k.step for k in tiers[1].replicas.index()]
                _answer({"step": max(steps) if steps else None})
            elif cmd == "fetch":
                holders.append(Holder(1, memory))
                tiers.append(PeerTier(holders[-1], "127.0.0.1", TOKEN, JOB, 1, memory))
                b, c = _Member("B", 0, tiers[1]), _Member("C", 1, tiers[-1])
                t0 = time.perf_counter()
                tiers[-1].round([b, c], 1, "C", 0, prefetch=True)
                took = (time.perf_counter() - t0) * 1000
                _answer({"env": {**holders[-1].env(), **tiers[-1].env()}, "fetch_ms": took})
                tiers.pop().close()
                # the holder stays until the next fetch or quit: the worker restores from it
            elif cmd == "drop":
                if len(holders) > 2:
                    holders.pop().close()
                _answer({})
            elif cmd == "quit":
                break
    finally:
        for t in tiers:
            t.close()
        for h in holders:
            h.close()


class Agents:
    """The bench's handle on that process."""

    def __init__(self, memory: int, replica_memory: Optional[int] = None) -> None:
        """``replica_memory``: the replicas' own bound (``--snapshot-replica-memory``)."""
        extra = [] if replica_memory is None else [str(replica_memory)]
        self.proc = subprocess.Popen([sys.executable, "-m", "bench._peer_agents", str(memory), *extra],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._lock = threading.Lock()  # the memory sampler asks from a thread of its own

    def ask(self, cmd: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self._lock:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the bench's agents process ended (exit {self.proc.wait()})")
        return dict(json.loads(line))

    def wait_replicated(self, step: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        got: Optional[int] = None
        while time.monotonic() < deadline:
            got = self.ask("replicated")["step"]
            if got is not None and got >= step:
                return
            time.sleep(0.05)
        raise RuntimeError(f"step {step} never reached the peer (newest there: {got})")

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    main()

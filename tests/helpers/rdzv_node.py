"""A rendezvous node as a real process: joins rounds on command, prints each result as JSON.

Reads commands from stdin ("join", "exit"); stays alive (heartbeating) between them, so a test
can SIGKILL it at any moment.
"""
from __future__ import annotations

import json
import sys

from elastictk.rendezvous import RendezvousConfig, RendezvousError, RendezvousHandler
from elastictk.store import TCPStore


def main() -> None:
    endpoint, job, node_id, lo, hi = sys.argv[1:6]
    cfg = RendezvousConfig(job, int(lo), int(hi), last_call=0.5, join_timeout=30,
                           heartbeat_interval=0.1, heartbeat_timeout=1.0)
    h = RendezvousHandler(TCPStore.connect(endpoint), cfg, node_id=node_id, meta={"pid": __import__("os").getpid()})
    print(json.dumps({"ready": node_id}), flush=True)
    for line in sys.stdin:
        if line.strip() == "join":
            try:
                info = h.next_round()
                print(json.dumps({"round": info.round, "rank": info.rank, "world": info.world_size,
                                  "members": [m.node_id for m in info.members]}), flush=True)
            except RendezvousError as e:
                print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
        elif line.strip() == "exit":
            break
    h.close()


if __name__ == "__main__":
    main()

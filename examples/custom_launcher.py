"""A launcher of your own from elastictk's primitives, in about fifty lines.

It hosts a c10d TCPStore, runs function workers (not a script) in 3 processes, restarts them
under an Erlang-style restart intensity (at most 3 restarts in 60 s) with backoff, and prints
every agent event. Rank 1 fails once to show the restart.

    python examples/custom_launcher.py
"""
from __future__ import annotations

import os
import tempfile

from elastictk.agent import AgentConfig, Backoff, ElasticAgent, RestartPolicy
from elastictk.rendezvous import RendezvousConfig
from elastictk.store import TCPStore
from elastictk.supervisor import WorkerSpec


def work(greeting: str) -> str:
    """A worker: any picklable function; it gets torchrun's environment."""
    rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if rank == 1 and restart == 0:
        raise RuntimeError("rank 1 fails on its first attempt")
    return f"{greeting} from rank {rank} of {os.environ['WORLD_SIZE']} (restart {restart})"


def show(kind: str, **fields: object) -> None:
    print(f"event {kind}: {fields}", flush=True)


def main() -> int:
    store = TCPStore.serve("127.0.0.1", 0)  # port 0: a free port, reported by store.port
    with tempfile.TemporaryDirectory() as logs:
        agent = ElasticAgent(
            AgentConfig(
                spec=WorkerSpec(entrypoint=work, args=("hello",), local_world_size=3, start_method="spawn"),
                rdzv=RendezvousConfig("custom-job", min_nodes=1, max_nodes=1),
                policy=RestartPolicy(max_restarts=None, intensity=(3, 60.0), backoff=Backoff(initial=0.2)),
                max_restarts=3,
                log_dir=logs,
                on_event=show,
            ),
            store,
            store_endpoint=f"127.0.0.1:{store.port}",
        )
        result = agent.run()
    store.close()
    for rank, value in sorted(result.return_values.items()):
        print(f"rank {rank} returned: {value}")
    print(f"{result.state} after {result.restarts} restart(s)")
    return result.exit_code


if __name__ == "__main__":
    raise SystemExit(main())

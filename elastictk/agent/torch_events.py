"""torch's event API fed from elastictk's agent, beside elastictk's own event log.

Platforms built on torchrun read its events through ``torch.distributed.elastic.events``: a
handler registered under a name (``--event-log-handler NAME``) receives every
``torchelastic.worker.status.<STATE>`` event torchrun's agent records. :class:`TorchEvents`
records the same names, sources and metadata fields from elastictk's events:

- ``RENDEZVOUS`` (agent, ``duration_ms``) when this node joined a round, and
  ``ASSIGN_WORKER_RANKS`` (agent, ``duration_ms``: from then until its workers started);
- ``START`` (worker) for each worker started;
- at the end of a run, one event per worker of the last attempt: ``SUCCEEDED``, ``FAILED`` (the
  workers that failed) or ``TERMINATED`` (those stopped because another failed);
- :func:`record_agent_end` (``run.py``): one agent event, ``SUCCEEDED`` when the agent's run
  returned (whatever its workers did) and ``FAILED`` when it ended by a signal or an error,
  through ``torch.distributed.elastic.events.record`` looked up at the call, as torchrun's
  launcher does (a test patching that name sees exactly this one call).

The per-worker and rendezvous events go through the ``record`` torch's own agent imported, so
they reach the same handlers without counting as the launcher's call.
"""
from __future__ import annotations

import json
import socket
import time
from typing import Any, Callable

from ..metrics.kinds import EventKind
from ..supervisor.env import Assignment

_PREFIX = "torchelastic.worker.status."


class TorchEvents:
    """An ``on_event`` that turns elastictk's events into torch's; never raises."""

    def __init__(self, handler: str, *, run_id: str, role: str, entrypoint: str, backend: str,
                 max_restarts: int, assignment: Callable[[], Assignment | None] = lambda: None) -> None:
        self.handler, self.run_id, self.role = handler, run_id, role
        self.entrypoint, self.backend, self.max_restarts = entrypoint, backend, max_restarts
        self.assignment = assignment  # the agent's current one (set once the agent exists)
        self._start = time.monotonic()
        self._rdzv_since: float | None = None
        self._joined: float | None = None
        self._group = (0, 1)  # (group rank, group world size)
        self._restarts = 0
        self._pids: dict[int, int] = {}
        self._failed: dict[int, str] = {}  # local rank -> exit
        self._ended = False

    def __call__(self, kind: EventKind, **fields: Any) -> None:
        try:
            self._on(kind, fields)
        except Exception:  # noqa: BLE001 - a platform's handler must never stop the agent
            pass

    def _on(self, kind: EventKind, f: dict[str, Any]) -> None:
        if kind == EventKind.RENDEZVOUS_STARTED:
            self._rdzv_since = time.monotonic()
        elif kind == EventKind.ROUND_JOINED:
            self._group = (int(f.get("rank", 0)), int(f.get("world", 1)))
            since = self._rdzv_since if self._rdzv_since is not None else time.monotonic()
            self._joined = time.monotonic()
            self._worker_api(self._event("RENDEZVOUS", agent=True,
                                         duration_ms=(self._joined - since) * 1000))
        elif kind == EventKind.WORKERS_STARTED:
            if self._joined is not None:  # ranks assigned and workers started since the round
                self._worker_api(self._event("ASSIGN_WORKER_RANKS", agent=True,
                                             duration_ms=(time.monotonic() - self._joined) * 1000))
                self._joined = None
            self._pids = {int(lr): int(pid) for lr, pid in dict(f.get("pids") or {}).items()}
            self._restarts = int(f.get("restart_count", 0))
            self._failed = {}
            for lr in sorted(self._pids):
                self._worker_api(self._event("START", local_rank=lr))
        elif kind == EventKind.WORKER_FAILED:
            self._failed[int(f.get("local_rank", -1))] = str(f.get("exit", ""))
        elif kind in (EventKind.JOB_FINISHED, EventKind.JOB_FAILED) and not self._ended:
            self._ended = True
            ok = kind == EventKind.JOB_FINISHED
            for lr in sorted(self._pids):
                state = "SUCCEEDED" if ok else "FAILED" if lr in self._failed else "TERMINATED"
                self._worker_api(self._event(state, local_rank=lr, exit=self._failed.get(lr)))

    def _event(self, state: str, *, local_rank: int | None = None, agent: bool = False,
               duration_ms: float | None = None, exit: str | None = None) -> Any:
        """An Event with the fields torch's ``SimpleElasticAgent._construct_event`` fills."""
        from torch.distributed.elastic.events import Event, EventSource

        group_rank, group_world = self._group
        md: dict[str, Any] = {"group_world_size": group_world, "entry_point": self.entrypoint}
        global_rank = worker_id = None
        if local_rank is not None and not agent:
            a = self.assignment()
            pid = self._pids.get(local_rank)
            code = None if exit is None or not exit.startswith("code ") else int(exit[5:])
            md.update(local_rank=(local_rank,),
                      role_rank=(a.role_rank(local_rank) if a else None,),
                      role_world_size=(a.role_size if a else None,),
                      exit_code=(code,), worker_pid=(pid,))
            global_rank = a.global_rank(local_rank) if a else None
            worker_id = None if pid is None else str(pid)
        metadata = {
            "run_id": self.run_id, "global_rank": global_rank, "group_rank": group_rank,
            "worker_id": worker_id, "role": self.role, "hostname": socket.getfqdn(),
            "state": state, "total_run_time": int(time.monotonic() - self._start),
            "rdzv_backend": self.backend, "raw_error": exit, "metadata": json.dumps(md),
            "agent_restarts": self._restarts, "duration_ms": duration_ms,
        }
        source = EventSource.AGENT if agent or local_rank is None else EventSource.WORKER
        return Event(_PREFIX + state, source=source, metadata=metadata)

    def _worker_api(self, event: Any) -> None:
        if self.handler == "null":  # torch's NullHandler drops it: spare the import (~80 ms)
            return
        from torch.distributed.elastic.agent.server import api  # the record torch's agent uses

        api.record(event, self.handler)

    def agent_end(self, succeeded: bool) -> Any:
        """The agent's own end event (see :func:`record_agent_end`)."""
        return self._event("SUCCEEDED" if succeeded else "FAILED", agent=True)


def record_agent_end(bridge: TorchEvents, succeeded: bool) -> None:
    """torchrun's launcher's one ``events.record`` call at the end of a run; never raises."""
    try:
        from torch.distributed.elastic import events

        events.record(bridge.agent_end(succeeded), bridge.handler)
    except Exception:  # noqa: BLE001 - a platform's handler must never change the exit
        pass


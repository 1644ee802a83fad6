"""What one node's agent is told: :class:`AgentConfig`, which ``elastictk-run`` builds from
torchrun's flags and a custom launcher builds itself (``examples/custom_launcher.py``). Kept
apart from the agent's loop so that the settings a launcher can give read in one place."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..metrics.kinds import Emit
from ..metrics.steps import WorkerStepsBlock
from ..rendezvous import RendezvousConfig
from ..supervisor.spec import WorkerSpec
from .exclusion import ExclusionSettings
from .health import check_settings
from .master import WorkersStore
from .outcome import Recovery
from .policy import RestartPolicy
from .stragglers import StragglerSettings


@dataclass
class AgentConfig:
    """Everything one node's agent needs; ``elastictk-run`` builds it from torchrun's flags."""

    spec: WorkerSpec
    rdzv: RendezvousConfig
    policy: RestartPolicy = field(default_factory=lambda: RestartPolicy(max_restarts=0))
    max_restarts: int = 0
    log_dir: str | Path | None = None
    node_id: str | None = None
    local_addr: str | None = None
    exit_barrier_timeout: float = 300.0
    hosts_store: bool = False
    decision_timeout: float = 30.0
    on_event: Emit | None = None
    collective_timeout: float | None = None  # put every torch.distributed call under a timer
    progress_timeout: float | None = None  # no step of some rank for this long: hung (progress.py)
    # "learned" (progress of any kind against learned deadlines, progress_timeout the ceiling),
    # "fixed" (steps against progress_timeout) or "off" (docs/timers.md)
    hang_detection: str = "fixed"
    startup_timeout: float | None = None  # no first step of a rank within this long: hung
    steps: WorkerStepsBlock | None = None  # the steps block the progress watchdog reads (else its own)
    recovery: Recovery | str = Recovery.RESTART_ALL  # or IN_PLACE (agent/inplace.py); or the value
    reform_timeout: float = 30.0  # in-place: longest wait for survivors to re-form
    standby: bool = False  # in-place: a replacement is the preload server's warmed standby
    snapshot_memory: int | None = None  # the local snapshot tier: bytes of memfd this agent owns
    snapshot_replicas: int = 0  # the peer tier: other nodes holding each of this node's parts (0: off)
    snapshot_replica_memory: int | None = None  # the peer tier's replicas' bound (None: snapshot_memory)
    metrics_registry: Any = None  # a prometheus CollectorRegistry: the peer tier's replica lag goes there
    # Whether run() returns only once its store-watching threads ended (each may sit up to a
    # heartbeat interval in a store wait). Needed where the process goes on or exits normally:
    # finalizing Python under a thread inside a c10d call aborts it. elastictk-run ends with
    # os._exit right after, so it does not wait (a job's exit is up to a second sooner).
    join_watchers: bool = True
    # --max-no-progress-restarts: this many restarts in a row after which no rank completed a
    # step end the job (a crash loop); None or 0: off. Folded into ``policy`` (CrashLoop).
    max_no_progress_restarts: int | None = None
    # --health-check CMD: run (sh -c) before every round this node joins; a non-zero exit keeps
    # the node out, re-checked every health_interval seconds up to the join timeout (health.py).
    health_check: str | None = None
    health_interval: float = 60.0
    stragglers: StragglerSettings | None = None  # --straggler-*: name the rank the others wait for
    exclusion: ExclusionSettings | None = None  # --exclude-after/-cooldown: bad hosts out (excluded.py)
    # The workers' MASTER_ADDR/PORT and TORCHELASTIC_USE_AGENT_STORE as torchrun sets them
    # (agent/master.py; the caller closes it); None: a free port of group rank 0, False.
    workers_store: WorkersStore | None = None
    # --preempt-signal: the scheduler's warning that it ends the job (Slurm's --signal). The
    # agent forwards it, gives the workers the grace period, stops them and exits 75 (preempt.py).
    preempt_signal: int | None = None
    # --signals-to-handle: more signals that stop the job as SIGTERM does (torchrun's agent stops
    # its workers on each signal of that list, SIGQUIT among its defaults); SIGTERM, SIGINT and
    # SIGHUP always do, so no signal list leaves workers behind.
    stop_signals: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.recovery = Recovery(self.recovery)  # ValueError names a value that is neither
        check_settings(self.health_check, self.health_interval)
        if self.max_no_progress_restarts:  # ValueError for a value that is not a count >= 1
            self.policy = replace(self.policy, crash_loop=self.max_no_progress_restarts)

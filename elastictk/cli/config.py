"""``LaunchConfig``: everything ``elastictk-run`` was asked to do, validated, as plain data.

The CLI builds one from flags (:func:`elastictk.cli.args.parse_args`); a launcher written in
Python can build one directly and call :func:`validate` on it. Building an agent from it is the
runner's job, so this module never imports torch, opens a store or spawns a process.
:func:`check_system` holds the few checks that must look at this machine (files, PATH, ports);
they are kept apart from the pure ones so the pure ones can be property-tested.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
from dataclasses import dataclass, field

from ..snapshot.settings import MIN_REGION
from ..snapshot.settings import TIERS as SNAPSHOT_TIERS
from ..snapshot.trust import usable_root
from ..store.endpoint import Endpoint
from .preflight import (
    check_event_log, check_health_command, check_log_dir, check_writable_dir, shared_dir_first_fix,
)
from .values import (
    BACKENDS, HANG_MODES, MAX_COLLECTIVE_TIMEOUT, MAX_RESTART_BACKOFF, RECOVERY_MODES,
    START_METHODS, Std, UsageError,
    run_id_problem,
)

DEFAULT_C10D_PORT = 29400  # torch's c10d rendezvous default
DEFAULT_ETCD_PORT = 2379
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
DEFAULT_GRACE_PERIOD = 30.0  # torch's shutdown timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: ``--nproc-per-node`` may be at most the larger of these: each worker is a process, and a
#: typo (100000) would otherwise fork until the host gives out.
MIN_NPROC_BOUND = 1024
NPROC_PER_CPU = 4


def max_nproc_per_node() -> int:
    """The most workers one node may start on this host."""
    return max(MIN_NPROC_BOUND, NPROC_PER_CPU * (os.cpu_count() or 1))


@dataclass(frozen=True)
class LaunchConfig:
    """One node's launch request. Field names follow torch's ``LaunchConfig`` where they overlap.

    ``rdzv_endpoint`` is set for the network backends (c10d, etcd, static); ``rdzv_path`` for
    the file backend. Port 0 in ``rdzv_endpoint`` means "this node hosts the store on a free
    port" (``--standalone`` and torchrun's single-node default), which only a one-node job can
    use; ``standalone`` is true in both cases. ``entrypoint`` is the full worker argv, exactly
    as torchrun builds it (``--run-path`` keeps the same argv: the runner may run it in-process).
    ``redirects``/``tee`` hold one entry per local rank. ``warnings`` are lines the runner
    prints before starting (ignored or overridden flags), so parsing itself stays silent.
    """

    # --- torchrun's flags -------------------------------------------------------------------
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    rdzv_backend: str
    rdzv_endpoint: Endpoint | None
    run_id: str
    entrypoint: list[str]
    training_script: str
    training_script_args: list[str] = field(default_factory=list)
    rdzv_path: str | None = None
    rdzv_conf: dict[str, float | bool | str] = field(default_factory=dict)  # str: etcd TLS paths
    standalone: bool = False
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    start_method_given: bool = False
    role: str = "default"
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    log_dir: str | None = None
    redirects: dict[int, Std] = field(default_factory=dict)
    tee: dict[int, Std] = field(default_factory=dict)
    local_ranks_filter: frozenset[int] | None = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    local_addr: str | None = None
    signals_to_handle: tuple[signal.Signals, ...] = DEFAULT_SIGNALS
    virtual_local_rank: bool = False
    event_log_handler: str = "null"  # torch's events.handlers name (agent/torch_events.py)
    grace_period: float = DEFAULT_GRACE_PERIOD
    log_line_prefix_template: str | None = None
    # --logs-specs NAME: the torch LogsSpecs made from the torchrun.logs_specs entry point
    logs_specs: object | None = field(default=None, compare=False)
    # --- elastictk's own flags --------------------------------------------------------------
    recovery: str = "restart-all"
    standby: bool = False  # --standby: in place, a replaced worker becomes a warmed standby
    collective_timeout: float | None = None
    # --hang-detection learned|fixed|off (agent/pace.py, agent/hangjudge.py, docs/timers.md)
    hang_detection: str = "learned"
    # None: not given (learned: ceiling 300, stalls never killed) or off (--progress-timeout 0)
    progress_timeout: float | None = None
    startup_timeout: float | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_linger: float = 0.0  # seconds a failed job's exporter waits for a scrape (--metrics-linger)
    restart_intensity: tuple[int, float] | None = None
    restart_backoff: float = 0.0
    max_no_progress_restarts: int = 0  # 0: off (docs/launcher.md "Crash loops")
    health_check: str | None = None  # --health-check (docs/launcher.md "Health checks")
    health_interval: float = 60.0
    straggler_action: str = "off"  # --straggler-action off|report|exclude (docs/launcher.md "Stragglers")
    straggler_threshold: float = 1.5
    straggler_windows: int = 3
    straggler_interval: float = 5.0
    exclude_after: tuple[int, float] | None = None  # --exclude-after R/T (docs/launcher.md "Bad hosts")
    exclude_cooldown: float = 300.0
    rdzv_token: str | None = field(default=None, repr=False)
    # Every member of an etcd cluster (``--rdzv-endpoint a:2379,b:2379,c:2379``), in order;
    # ``rdzv_endpoint`` is the first. Empty for the other backends.
    rdzv_endpoints: tuple[Endpoint, ...] = ()
    event_log: str | None = None
    # Snapshot tiers of elastictk.State (docs/snapshots.md): "local", "peer", "disk".
    snapshot: tuple[str, ...] = ()
    snapshot_dir: str | None = None
    snapshot_every: int = 10
    snapshot_memory: int | None = None  # None: a quarter of this host's memory
    snapshot_overlap: bool = False  # pipelined commits (elastictk/snapshot/overlap.py)
    snapshot_replicas: int = 1  # the peer tier: other nodes holding each node's parts
    snapshot_replica_memory: int | None = None  # the replicas' bound; None: snapshot_memory's
    # Slurm (docs/slurm.md): this node's rendezvous id (its Slurm name under srun; None: a
    # generated one); the signal that means "pre-empted" (None: off); requeue after it
    # (scontrol requeue); drain this node in Slurm when it is excluded or fails its check.
    node_id: str | None = None
    preempt_signal: signal.Signals | None = None
    requeue: bool = False
    slurm_drain: bool = False
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # lines the runner prints as facts (where defaults came from)

    @property
    def is_host(self) -> bool | None:
        """``rdzv_conf``'s ``is_host``; ``None`` means infer it from the endpoint, as torch does."""
        value = self.rdzv_conf.get("is_host")
        return None if value is None else bool(value)

    def store_port_to_bind(self) -> int | None:
        """The fixed port this node must bind to host the rendezvous store, if known up front.

        static: node rank 0 hosts the master store. c10d: only with ``is_host=true``; when
        inferred, torch falls back to being a client if the port is taken (another agent on
        this host got there first), so a busy port is not an error then. Port 0 binds a free
        port, which never clashes.
        """
        ep = self.rdzv_endpoint
        if ep is None or ep.port == 0:
            return None
        if self.rdzv_backend == "static" and self.node_rank == 0:
            return ep.port
        if self.rdzv_backend == "c10d" and self.is_host is True:
            return ep.port
        return None


def validate(config: LaunchConfig) -> list[str]:
    """Every problem with ``config`` as one line each (empty when it is sound); pure."""
    return _rendezvous_problems(config) + _process_problems(config)


def _rendezvous_problems(c: LaunchConfig) -> list[str]:
    """Node counts, workers per node, backend and endpoint, job id, node rank."""
    out: list[str] = []
    if c.min_nodes < 1 or c.max_nodes < 1:
        out.append(f"nnodes {c.min_nodes}:{c.max_nodes}: node counts must be at least 1")
    elif c.min_nodes > c.max_nodes:
        out.append(
            f"min {c.min_nodes} > max {c.max_nodes}: use --nnodes MIN:MAX with MIN <= MAX"
        )
    if c.nproc_per_node < 1:
        out.append(f"nproc_per_node {c.nproc_per_node}: need at least 1 worker per node")
    if c.rdzv_backend not in BACKENDS:
        out.append(f"rdzv_backend {c.rdzv_backend!r}: use one of {', '.join(BACKENDS)}")
    elif c.rdzv_backend == "file":
        if not c.rdzv_path:
            out.append("the file backend needs --rdzv-endpoint PATH (a file all nodes can reach)")
    elif c.rdzv_endpoint is None:
        out.append(f"the {c.rdzv_backend} backend needs an endpoint (--rdzv-endpoint HOST:PORT)")
    elif c.rdzv_endpoint.port == 0 and c.max_nodes > 1:
        out.append(
            f"rdzv endpoint {c.rdzv_endpoint} has port 0 (a free port only this node knows), "
            f"but up to {c.max_nodes} nodes may join: give a fixed port"
        )
    if not c.run_id or "/" in c.run_id:
        out.append(f"rdzv id {c.run_id!r}: must be non-empty and contain no '/'")
    elif (problem := run_id_problem(c.run_id)) is not None:
        out.append(f"rdzv id {c.run_id!r}: {problem}")
    if c.rdzv_backend == "static" and not 0 <= c.node_rank < c.max_nodes:
        out.append(
            f"node rank {c.node_rank}: static rendezvous with {c.max_nodes} node(s) needs "
            f"--node-rank in 0..{c.max_nodes - 1}"
        )
    if c.node_rank < 0:
        out.append(f"node rank {c.node_rank}: must be at least 0")
    return out


def _process_problems(c: LaunchConfig) -> list[str]:
    """Restarts, timings, start method, recovery, role, entrypoint, ports."""
    out: list[str] = []
    if c.max_restarts < 0:
        out.append(f"max restarts {c.max_restarts}: must be at least 0")
    if c.max_no_progress_restarts < 0:
        out.append(f"max no-progress restarts {c.max_no_progress_restarts}: must be at least 0 (0: off)")
    if not c.monitor_interval > 0:
        out.append(f"monitor interval {c.monitor_interval}: must be more than 0 seconds")
    if c.start_method not in START_METHODS:
        out.append(f"start method {c.start_method!r}: use one of {', '.join(START_METHODS)}")
    if c.hang_detection not in HANG_MODES:
        out.append(f"hang detection {c.hang_detection!r}: use one of {', '.join(HANG_MODES)}")
    if c.recovery not in RECOVERY_MODES:
        out.append(f"recovery {c.recovery!r}: use one of {', '.join(RECOVERY_MODES)}")
    if not c.role:
        out.append("role is empty: give --role a name")
    if not c.entrypoint or not c.training_script:
        out.append("no training script: elastictk-run [flags] SCRIPT [ARGS...]")
    if c.module and c.no_python:
        out.append("--module and --no-python cannot be used together: choose one")
    if not c.grace_period >= 0:
        out.append(f"grace period {c.grace_period}: must be 0 or more seconds")
    if c.collective_timeout is not None and not c.collective_timeout > 0:
        out.append(f"collective timeout {c.collective_timeout}: must be more than 0 seconds")
    elif c.collective_timeout is not None and c.collective_timeout > MAX_COLLECTIVE_TIMEOUT:
        out.append(f"collective timeout {c.collective_timeout:g}: must be at most "
                   f"{MAX_COLLECTIVE_TIMEOUT:g} seconds (1 day)")
    for name, value in (("progress", c.progress_timeout), ("startup", c.startup_timeout)):
        if value is not None and not 0 < value <= MAX_COLLECTIVE_TIMEOUT:
            out.append(f"{name} timeout {value}: must be more than 0 and at most "
                       f"{MAX_COLLECTIVE_TIMEOUT:g} seconds (None turns it off)")
    if c.restart_backoff < 0:
        out.append(f"restart backoff {c.restart_backoff}: must be 0 or more seconds")
    elif c.restart_backoff > MAX_RESTART_BACKOFF:
        out.append(f"restart backoff {c.restart_backoff:g}: must be at most "
                   f"{MAX_RESTART_BACKOFF:g} seconds (the backoff's cap)")
    if c.restart_intensity is not None and (
        c.restart_intensity[0] < 0 or not c.restart_intensity[1] > 0
    ):
        out.append(f"restart intensity {c.restart_intensity}: need R >= 0 and T > 0")
    for name in ("master_port", "metrics_port"):
        port = getattr(c, name)
        if port is not None and not 0 <= port <= 65535:
            out.append(f"{name} {port}: out of range 0-65535")
    return out + _snapshot_problems(c)


def _snapshot_problems(c: LaunchConfig) -> list[str]:
    out: list[str] = []
    bad = [t for t in c.snapshot if t not in SNAPSHOT_TIERS]
    if bad:
        out.append(f"snapshot tier {bad[0]!r}: use local, peer, disk or a comma list")
    if c.snapshot_replicas < 1:
        out.append(f"snapshot replicas {c.snapshot_replicas}: at least 1 other node")
    if "disk" in c.snapshot and not c.snapshot_dir:
        out.append("--snapshot disk needs --snapshot-dir DIR (a directory every node sees)")
    if c.snapshot_every < 1:
        out.append(f"snapshot every {c.snapshot_every}: at least 1 commit")
    if c.snapshot_memory is not None and c.snapshot_memory < MIN_REGION:
        out.append(f"snapshot memory {c.snapshot_memory}: at least {MIN_REGION} bytes")
    if c.snapshot_replica_memory is not None and c.snapshot_replica_memory < MIN_REGION:
        out.append(f"snapshot replica memory {c.snapshot_replica_memory}: at least {MIN_REGION} bytes")
    return out


def check_system(config: LaunchConfig) -> None:
    """Checks that look at this machine; raises :class:`UsageError` on the first problem.

    Run once before launching, so a typo in the script path fails in a second with one line
    instead of after a rendezvous round with N restarts of a worker that cannot start.
    """
    c = config
    if c.nproc_per_node > max_nproc_per_node():
        raise UsageError(
            f"--nproc-per-node {c.nproc_per_node}: at most {max_nproc_per_node()} workers per "
            "node on this host: each worker is a process; use fewer workers per node"
        )
    _check_script(c)
    if c.log_dir is not None and c.logs_specs is None:  # a --logs-specs class judges its own
        check_log_dir(c.log_dir)
    if c.event_log is not None:
        check_event_log(c.event_log)
    if c.health_check is not None:
        check_health_command(c.health_check)
    if c.snapshot_dir is not None and "disk" in c.snapshot:
        shared_dir_first_fix(c.snapshot_dir, "--snapshot-dir")
        why = usable_root(c.snapshot_dir)
        if why is not None:
            raise UsageError(f"--snapshot-dir {c.snapshot_dir}: {why}; pick a directory of your "
                             "own that only you can write (it is created mode 0700 if missing)")
        check_writable_dir(c.snapshot_dir, "--snapshot-dir")  # a real probe: /proc/x as root
    if c.rdzv_path is not None:
        parent = os.path.dirname(os.path.abspath(c.rdzv_path))
        if not os.path.isdir(parent):
            raise UsageError(
                f"--rdzv-endpoint {c.rdzv_path}: directory {parent} does not exist; the file "
                "backend needs a path in an existing (shared) directory"
            )
    _check_ports(c)


def _check_script(c: LaunchConfig) -> None:
    """The training script is a file, or the ``--no-python`` program is executable/on PATH."""
    script = c.training_script
    if c.no_python and not c.run_path:
        if os.sep in script:
            if not (os.path.isfile(script) and os.access(script, os.X_OK)):
                raise UsageError(
                    f"--no-python: {script!r} is not an executable file; check the path "
                    "and its execute permission"
                )
        elif shutil.which(script) is None:
            raise UsageError(
                f"--no-python: {script!r} is not found on PATH; give its full path"
            )
    elif not c.module and os.path.isdir(script):
        if not os.path.isfile(os.path.join(script, "__main__.py")):  # what python DIR runs
            raise UsageError(
                f"training script {script!r} is a directory, with no __main__.py to run; "
                "pass the script inside it (DIR/train.py), or -m for a module"
            )
    elif not c.module and not os.path.isfile(script):
        raise UsageError(
            f"training script {script!r} not found (looked in {os.getcwd()}); pass an existing "
            "file, or -m for a module, or --no-python for a program"
        )


def _check_ports(c: LaunchConfig) -> None:
    """The store port this node must host, and the metrics port, are free."""
    port, ep = c.store_port_to_bind(), c.rdzv_endpoint
    if port is not None and ep is not None and port_taken("", port, ep.host):
        if c.rdzv_backend == "static":
            raise UsageError(
                f"--master-port {port}: the port is already in use on this host, and node rank 0 "
                "hosts the store there; pass a free --master-port (or --standalone for one node)"
            )
        raise UsageError(
            f"--rdzv-endpoint {c.rdzv_endpoint}: port {port} is already in use on this host, and "
            "is_host=true makes this node host the store there; pick a free port"
        )
    if c.metrics_port and port_taken(c.metrics_host, c.metrics_port, c.metrics_host):
        raise UsageError(
            f"--metrics-port {c.metrics_port}: already in use on {c.metrics_host}; pick a free "
            "port, or 0 for any free one"
        )


def port_taken(bind_host: str, port: int, family_hint: str) -> bool:
    """Whether a listener already holds ``port``; ``bind_host=""`` checks all interfaces.

    SO_REUSEADDR keeps a port left in TIME_WAIT by a previous run from counting as taken (the
    c10d store sets it too); only a live listener makes the bind fail.
    """
    family = socket.AF_INET6 if ":" in family_hint else socket.AF_INET
    if bind_host == "" and family == socket.AF_INET6:
        bind_host = "::"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind_host, port))
        except OSError:
            return True
    return False

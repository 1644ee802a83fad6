"""Building one node's agent from a :class:`LaunchConfig`: what ``elastictk-run`` does with its flags.

A custom launcher that wants torchrun's semantics but its own front (a scheduler shim, a
notebook helper) parses or builds a ``LaunchConfig`` and calls :func:`build_agent`; one that
wants other semantics builds an :class:`AgentConfig` itself (see ``docs/launcher-authors.md``).
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from ..cli.config import LaunchConfig
from ..rendezvous import RendezvousConfig
from ..rendezvous.backends import StoreHandle
from ..rendezvous.auth import Signer
from ..rendezvous.sealed import derive_key
from ..snapshot.settings import ENV_DIR, ENV_EVERY, ENV_KEY, ENV_OVERLAP, ENV_TIERS, default_memory
from ..supervisor.forkserver import PreloadServer
from ..supervisor.preloadpick import preload_for
from ..supervisor.spec import WorkerSpec
from ..metrics.kinds import Emit, EventKind
from .master import WorkersStore
from .torch_events import TorchEvents
from .outcome import Recovery
from .policy import Backoff, RestartPolicy
from .exclusion import ExclusionSettings
from .stragglers import StragglerSettings

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # pragma: no cover
    from ..metrics import Telemetry
    from .elastic import ElasticAgent


def build_agent(config: LaunchConfig, telemetry: Telemetry | None = None, *,
                preload_server: PreloadServer | None = None) -> tuple[ElasticAgent, StoreHandle]:
    """The store and the agent for ``config``; split from :func:`main` for custom launchers.
    ``preload_server`` (the caller's, see :func:`start_preload`) is the one workers fork from."""
    # Imported here: these import torch, and start_preload must run before torch is imported.
    from ..rendezvous.backends import open_store
    from .config import AgentConfig
    from .elastic import ElasticAgent

    conf = config.rdzv_conf
    endpoint = config.rdzv_path if config.rdzv_backend == "file" else str(config.rdzv_endpoint)
    if config.rdzv_endpoints:  # every member of an etcd cluster, for failover
        endpoint = ",".join(str(e) for e in config.rdzv_endpoints)
    handle = open_store(
        config.rdzv_backend, endpoint or "", is_host=True if config.standalone else config.is_host,
        timeout=float(conf.get("read_timeout", conf.get("timeout", 60.0))), node_rank=config.node_rank,
        conf=conf, single_node=config.max_nodes == 1, local_addr=config.local_addr,
    )
    workers_store = _workers_store(config, handle)
    handle.owned.append(workers_store)
    torch_events = TorchEvents(config.event_log_handler, run_id=config.run_id, role=config.role,
                               entrypoint=os.path.basename(config.entrypoint[0]) if config.entrypoint else "",
                               backend=config.rdzv_backend, max_restarts=config.max_restarts)
    hb = float(conf.get("heartbeat_interval", 1.0))
    rdzv = RendezvousConfig(
        job_id=config.run_id, min_nodes=config.min_nodes, max_nodes=config.max_nodes,
        last_call=float(conf.get("last_call_timeout", 30.0)),
        join_timeout=float(conf.get("join_timeout", 600.0)),
        heartbeat_interval=hb, heartbeat_timeout=float(conf.get("heartbeat_timeout", max(10.0, hb * 3))),
        token=config.rdzv_token or standalone_token(config),
    )
    backoff = Backoff(initial=config.restart_backoff) if config.restart_backoff > 0 else None
    policy = RestartPolicy(max_restarts=config.max_restarts, intensity=config.restart_intensity, backoff=backoff)
    method = worker_start_method(config)
    spec = WorkerSpec(
        entrypoint=config.entrypoint, local_world_size=config.nproc_per_node, role=config.role,
        start_method=method, redirects=config.redirects, tee=config.tee,
        local_ranks_filter=config.local_ranks_filter, grace_period=config.grace_period,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        log_line_prefix_template=config.log_line_prefix_template, logs_specs=config.logs_specs,
        virtual_local_rank=config.virtual_local_rank,
        env={**(telemetry.worker_env() if telemetry is not None else {}), **snapshot_env(config),
             **launcher_env(config)},
    )
    agent_cfg = AgentConfig(
        spec=spec, rdzv=rdzv, policy=policy, max_restarts=config.max_restarts,
        max_no_progress_restarts=config.max_no_progress_restarts,
        health_check=config.health_check, health_interval=config.health_interval,
        stragglers=StragglerSettings(config.straggler_action, config.straggler_threshold,
                                     config.straggler_windows, config.straggler_interval),
        exclusion=ExclusionSettings(config.exclude_after, config.exclude_cooldown,
                                    stragglers=config.straggler_action == "exclude"),
        log_dir=config.log_dir, local_addr=config.local_addr, hosts_store=handle.is_host,
        node_id=config.node_id, preempt_signal=config.preempt_signal,
        stop_signals=tuple(config.signals_to_handle),
        on_event=_fan_out(telemetry.on_event if telemetry is not None else None, torch_events),
        collective_timeout=config.collective_timeout,
        progress_timeout=config.progress_timeout, startup_timeout=config.startup_timeout,
        hang_detection=config.hang_detection,
        steps=telemetry.steps if telemetry is not None else None,
        recovery=Recovery(config.recovery), standby=config.standby,
        snapshot_memory=(config.snapshot_memory or default_memory()) if "local" in config.snapshot else None,
        snapshot_replicas=config.snapshot_replicas if "peer" in config.snapshot else 0,
        snapshot_replica_memory=config.snapshot_replica_memory if "peer" in config.snapshot else None,
        metrics_registry=telemetry.registry if telemetry is not None and telemetry.metrics is not None else None,
        workers_store=workers_store,
    )
    agent = ElasticAgent(agent_cfg, handle.store, store_endpoint=handle.endpoint,
                         preload_server=preload_server)
    torch_events.assignment = lambda: agent._assignment_now
    agent.torch_events = torch_events  # type: ignore[attr-defined]  # run.py records the end
    return agent, handle


def _fan_out(*emits: Emit | None) -> Emit:
    """One ``on_event`` calling each of ``emits`` in turn (elastictk's log, then torch's API)."""
    chain = [e for e in emits if e is not None]

    def emit(kind: EventKind, **fields: Any) -> None:
        for e in chain:
            e(kind, **fields)

    return emit


def _workers_store(config: LaunchConfig, handle: StoreHandle) -> WorkersStore:
    """torchrun's agent store for the workers: static's is the rendezvous store itself, at the
    endpoint's host and the port it listens on (port 0: the one it got)."""
    ep = config.rdzv_endpoint
    fixed = None
    if config.rdzv_backend == "static" and ep is not None:
        port = getattr(handle.store, "port", ep.port) if handle.is_host else ep.port
        fixed = (ep.host, int(port))
    return WorkersStore.for_backend(config.rdzv_backend, fixed, root=handle.store)


def launcher_env(config: LaunchConfig) -> dict[str, str]:
    """What torchrun's launcher puts in its own environment for the workers to inherit:
    ``TORCHELASTIC_SIGNALS_TO_HANDLE``, the ``--signals-to-handle`` names comma-separated (the
    form torch's ``PContext`` reads back)."""
    return {"TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(s.name for s in config.signals_to_handle)}


def snapshot_env(config: LaunchConfig) -> dict[str, str]:
    """The snapshot settings every worker reads (``elastictk.State``); the local tier's memory
    is added by the agent that owns it."""
    if not config.snapshot:
        return {}
    env = {ENV_TIERS: ",".join(config.snapshot), ENV_EVERY: str(config.snapshot_every)}
    if config.snapshot_dir:
        env[ENV_DIR] = config.snapshot_dir
        # Seals the disk tier's steps. From the token and job id, not the run's nonce: a
        # relaunch of the job restores the steps an earlier run wrote (--standalone draws a new
        # job id each launch: the token alone there). No --rdzv-token, no key: --standalone's
        # own token is random per launch; the directory checks remain (docs/security.md).
        if config.rdzv_token:
            job = "" if config.standalone else config.run_id
            env[ENV_KEY] = derive_key(Signer(config.rdzv_token, job), "snapshot") or ""
    if config.snapshot_overlap:
        env[ENV_OVERLAP] = "1"
    return env


def standalone_token(config: LaunchConfig) -> str | None:
    """A random per-run token for a ``--standalone`` job given none.

    A standalone job's store listens on loopback only (``rendezvous.backends.listen_address``),
    which every user of this host can still reach. With this token every record that can
    change what the agent does is sealed, and whatever a stranger writes there reads as absent.
    One node, so nobody else needs to know it; it goes to no worker and no log.
    """
    if not config.standalone or config.rdzv_backend != "c10d":
        return None
    import secrets

    return secrets.token_hex(16)


def start_preload(config: LaunchConfig) -> PreloadServer | None:
    """Start the fork server now, when workers will fork from it, before any thread starts here.

    This process imports torch first (its store and agent need it) and then forks the server
    (:mod:`elastictk.supervisor.forkstart`), which imports only the rest of its list while this
    process goes on to its rendezvous: torch is imported once per node instead of twice, and
    the server is ready as soon as it was when the two imports ran side by side.
    """
    if worker_start_method(config) != "preload":
        return None
    from ..store.cpplog import import_torch_quietly

    import_torch_quietly()  # what the agent imports next anyway, before the fork; its C++ log quiet

    server = PreloadServer(preload_for(config.entrypoint), job=config.run_id)
    server.start(fork=True)
    log.debug("preload server %s: %s; preloads %s", server.pid, server.how, ", ".join(server.preload))
    return server


def worker_start_method(config: LaunchConfig) -> str:
    """How script workers start: from the preloaded fork server unless told otherwise.

    torchrun ignores ``--start-method`` for scripts and always starts a fresh interpreter, which
    re-imports torch on every restart (seconds). elastictk forks Python workers from a server
    that imported torch once, unless ``--start-method`` is given (then spawn/fork/forkserver
    mean a fresh interpreter, as in torchrun) or the entrypoint is not Python (``--no-python``).
    """
    if config.start_method == "preload":
        return "preload"
    if config.start_method_given or config.no_python:
        return "subprocess"
    return "preload"

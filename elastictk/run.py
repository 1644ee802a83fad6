"""``elastictk-run`` (and ``python -m elastictk.run``): torchrun's command line on elastictk's parts.

``main(argv)`` parses torchrun's flags into a :class:`LaunchConfig`, opens (or hosts) the
rendezvous store, and runs one :class:`ElasticAgent` for this node. Exit codes: 0 when the job
finished (also when this node arrived after it finished), 1 when it failed (the root cause is
printed), 2 for bad input, 128+N when the agent was stopped by signal N.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Sequence

from .cli import LaunchConfig, parse_or_exit
from .cli.args import PROG

log = logging.getLogger("elastictk.run")


def _setup_logging() -> None:
    root = logging.getLogger("elastictk")
    if not root.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(f"[{PROG}] %(message)s"))
        root.addHandler(h)
    root.setLevel(os.environ.get("ELASTICTK_LOG_LEVEL", "INFO").upper())


def build_agent(config: LaunchConfig, telemetry: "Telemetry | None" = None, *,
                preload_server: "PreloadServer | None" = None) -> tuple["ElasticAgent", "StoreHandle"]:
    """The store and the agent for ``config``; split from :func:`main` for custom launchers.
    ``preload_server`` (the caller's, see :func:`start_preload`) is the one workers fork from."""
    from .rendezvous import RendezvousConfig
    from .rendezvous.backends import open_store
    from .supervisor.agent import AgentConfig, ElasticAgent
    from .supervisor.policy import Backoff, RestartPolicy
    from .supervisor.spec import WorkerSpec

    conf = config.rdzv_conf
    endpoint = config.rdzv_path if config.rdzv_backend == "file" else str(config.rdzv_endpoint)
    if config.rdzv_endpoints:  # every member of an etcd cluster, for failover
        endpoint = ",".join(str(e) for e in config.rdzv_endpoints)
    handle = open_store(
        config.rdzv_backend, endpoint or "", is_host=True if config.standalone else config.is_host,
        timeout=float(conf.get("read_timeout", conf.get("timeout", 60.0))), node_rank=config.node_rank,
    )
    hb = float(conf.get("heartbeat_interval", 1.0))
    rdzv = RendezvousConfig(
        job_id=config.run_id, min_nodes=config.min_nodes, max_nodes=config.max_nodes,
        last_call=float(conf.get("last_call_timeout", 30.0)),
        join_timeout=float(conf.get("join_timeout", 600.0)),
        heartbeat_interval=hb, heartbeat_timeout=float(conf.get("heartbeat_timeout", max(10.0, hb * 3))),
        token=config.rdzv_token,
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
        log_line_prefix_template=config.log_line_prefix_template,
        env=telemetry.worker_env() if telemetry is not None else {},
    )
    agent_cfg = AgentConfig(
        spec=spec, rdzv=rdzv, policy=policy, max_restarts=config.max_restarts,
        log_dir=config.log_dir, local_addr=config.local_addr, hosts_store=handle.is_host,
        on_event=telemetry.on_event if telemetry is not None else None,
        collective_timeout=config.collective_timeout,
        recovery=config.recovery,
    )
    agent = ElasticAgent(agent_cfg, handle.store, store_endpoint=handle.endpoint,
                         preload_server=preload_server)
    return agent, handle


def start_preload(config: LaunchConfig) -> "PreloadServer | None":
    """Start the fork server's import of torch now, when workers will fork from it.

    Called before this process imports torch itself (the store and agent modules need it):
    the two imports then run side by side instead of one after the other, which on a cold
    start is most of a second of the time to the first step.
    """
    if worker_start_method(config) != "preload":
        return None
    from .supervisor.forkserver import PreloadServer

    server = PreloadServer()
    server.start()
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


def main(argv: Sequence[str] | None = None, *, exits: bool = False) -> int:
    """Run one node of a job; returns the exit code (the console script exits with it).
    ``exits``: the caller ends the process with ``os._exit`` at once (see console_main)."""
    config = parse_or_exit(list(sys.argv[1:] if argv is None else argv))
    _setup_logging()
    server = start_preload(config)
    try:
        result = _run(config, server, join_watchers=not exits)
    finally:
        if server is not None:
            server.close()
    if result is None:
        return 1
    if result.report is not None:
        print(result.report.render(), file=sys.stderr)
    level = logging.INFO if result.exit_code == 0 else logging.ERROR
    log.log(level, "%s (exit %d): %s", result.state, result.exit_code, result.message)
    return result.exit_code


if TYPE_CHECKING:  # pragma: no cover
    from .metrics import Telemetry
    from .rendezvous.backends import StoreHandle
    from .supervisor.agent import AgentResult, ElasticAgent
    from .supervisor.forkserver import PreloadServer


def _run(config: LaunchConfig, server: "PreloadServer | None", *,
         join_watchers: bool) -> "AgentResult | None":
    """The agent's run, or None after printing why it could not start."""
    from .metrics import Telemetry, TelemetryError
    from .store import StoreError

    try:
        telemetry = Telemetry.from_launch(config)
    except TelemetryError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return None
    try:
        try:
            agent, handle = build_agent(config, telemetry, preload_server=server)
        except StoreError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return None
        agent.config.join_watchers = join_watchers
        try:
            return agent.run()
        finally:
            handle.close()
    finally:
        telemetry.close()


def console_main() -> None:
    code = main(exits=True)
    # Exit without interpreter teardown: watch threads may still sit inside a C++ store call
    # (a wait on a store that went away, or on a cut link), and finalizing Python under them
    # aborts the process ("terminate called without an active exception") instead of exiting
    # with the agent's code. Everything the agent owns is already stopped and closed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    console_main()

"""Turn parsed ``elastictk-run`` flags into a :class:`LaunchConfig`, the way torchrun does.

torchrun spreads this over ``run()`` (``--standalone`` and its single-node default) and
``config_from_args()`` (types, entrypoint, warnings); here it is one function over the parsed
namespace, so every default, override and cross-check lives in one place. Values arrive as text
(:class:`EnvText` when they came from the environment) and are typed here, so each error line
names the flag or variable the bad value came from.
"""
from __future__ import annotations

import argparse
import os
import sys
import uuid
from typing import Callable, Mapping

from ..store.endpoint import Endpoint, EndpointError, parse_endpoint
from .config import (
    DEFAULT_C10D_PORT, DEFAULT_ETCD_PORT, DEFAULT_GRACE_PERIOD, DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT, LaunchConfig, validate,
)
from .values import (
    RECOVERY_MODES, START_METHODS, EnvText, Std, UsageError, expand_std, label, parse_backend,
    parse_bool, parse_choice, parse_int, parse_intensity, parse_nnodes, parse_nproc, parse_port,
    parse_filters, parse_ranks, parse_rdzv_conf, parse_seconds, parse_signals, parse_std,
)

PROG = "elastictk-run"


def _flag_on(ns: argparse.Namespace, dest: str, flag: str) -> bool:
    value = getattr(ns, dest)
    return value if isinstance(value, bool) else parse_bool(value, label(flag, value))


def _resolve_nproc(value: int | str, where: str) -> int:
    """cpu/gpu/auto to a count, as torchrun does; torch is imported only when a GPU is asked."""
    if isinstance(value, int):
        return value
    if value == "cpu":
        if hasattr(os, "sched_getaffinity"):  # respects taskset/cgroups, as torch's cpu_count
            return len(os.sched_getaffinity(0))
        return os.cpu_count() or 1
    import torch  # noqa: PLC0415  (slow import, needed only here)

    if torch.cuda.is_available():
        return int(torch.cuda.device_count())
    if value == "gpu":
        raise UsageError(f"{where}: CUDA is not available on this host; use a number or cpu")
    return _resolve_nproc("cpu", where)


def _endpoint(text: str, where: str, default_port: int) -> Endpoint:
    try:
        return parse_endpoint(text, default_port=default_port)
    except EndpointError as e:
        raise UsageError(f"{where}: {e}") from None


def _host(text: str, where: str) -> str:
    """A bare host (``[v6]`` brackets allowed); a port here is almost always a mistake."""
    try:
        parse_endpoint(text)
    except EndpointError:
        return _endpoint(text, where, 0).host
    raise UsageError(f"{where}: give a host without a port")


def config_from_namespace(
    ns: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> LaunchConfig:
    """Type, default and cross-check parsed flags the way torchrun's ``run``/``config_from_args``
    do; raises :class:`UsageError` on the first bad value."""
    env = os.environ if environ is None else environ
    warnings: list[str] = []

    def at(dest: str, flag: str) -> str:
        return label(flag, getattr(ns, dest))

    for dest, flag in (("logs_specs", "--logs-specs"), ("numa_binding", "--numa-binding")):
        if getattr(ns, dest):
            raise UsageError(f"{flag} is not supported by {PROG}; leave it out")
    if ns.event_log_handler is not None and ns.event_log_handler.strip() != "null":
        raise UsageError(
            f"{at('event_log_handler', '--event-log-handler')}: torch event handlers are not "
            "supported; use --event-log PATH for a JSON-lines event log"
        )

    nnodes_text = ns.nnodes or "1:1"
    min_nodes, max_nodes = parse_nnodes(nnodes_text, at("nnodes", "--nnodes"))
    nproc_where = at("nproc_per_node", "--nproc-per-node")
    nproc = _resolve_nproc(parse_nproc(ns.nproc_per_node or "1", nproc_where), nproc_where)
    backend = parse_backend(ns.rdzv_backend or "static", at("rdzv_backend", "--rdzv-backend"))
    endpoint_text = (ns.rdzv_endpoint or "").strip()
    run_id = ns.rdzv_id if ns.rdzv_id is not None else "none"

    standalone = _flag_on(ns, "standalone", "--standalone")
    if standalone:
        overridden = [f for d, f in (("rdzv_backend", "--rdzv-backend"),
                                     ("rdzv_endpoint", "--rdzv-endpoint"), ("rdzv_id", "--rdzv-id"))
                      if getattr(ns, d) is not None]
        if overridden:
            warnings.append(f"--standalone ignores {', '.join(overridden)}: it uses a c10d store "
                            "on localhost with a free port and a random id")
        if min_nodes > 1:
            raise UsageError(
                f"--standalone runs one node, but {at('nnodes', '--nnodes')} needs {min_nodes}: "
                "drop --standalone and give every node the same --rdzv-endpoint"
            )
        if max_nodes > 1:
            warnings.append(f"--standalone runs one node: ignoring {at('nnodes', '--nnodes')}")
            max_nodes = 1
    elif backend == "static" and not endpoint_text and ns.master_port is None and max_nodes == 1:
        standalone = True  # torchrun's single-node default: a c10d store on a free port
        if ns.rdzv_id is not None:
            warnings.append("one node with no --master-port runs a local c10d store with a "
                            "random id (as torchrun does); ignoring --rdzv-id")
    if standalone:
        backend, endpoint_text, run_id = "c10d", "localhost:0", str(uuid.uuid4())

    master_port = (DEFAULT_MASTER_PORT if ns.master_port is None
                   else parse_port(ns.master_port, at("master_port", "--master-port")))
    master_addr = (DEFAULT_MASTER_ADDR if ns.master_addr is None
                   else _host(ns.master_addr, at("master_addr", "--master-addr")))
    node_rank = (0 if ns.node_rank is None
                 else parse_int(ns.node_rank, at("node_rank", "--node-rank"), minimum=0))

    ep_where = at("rdzv_endpoint", "--rdzv-endpoint")
    rdzv_endpoint: Endpoint | None = None
    rdzv_path: str | None = None
    etcd_members: tuple[Endpoint, ...] = ()
    if backend == "file":
        if not endpoint_text:
            raise UsageError("--rdzv-backend file needs --rdzv-endpoint PATH (a file on a "
                             "filesystem every node can reach)")
        rdzv_path = endpoint_text
    elif backend == "static":
        if endpoint_text:
            rdzv_endpoint = _endpoint(endpoint_text, ep_where, master_port)
        else:
            rdzv_endpoint = Endpoint(master_addr, master_port)
        if min_nodes != max_nodes:
            warnings.append(f"static rendezvous has a fixed size: {at('nnodes', '--nnodes')} "
                            f"runs as {max_nodes} nodes")
        if master_port == 0 and max_nodes > 1:
            raise UsageError(f"{at('master_port', '--master-port')}: port 0 (a free port only "
                             "node 0 knows) cannot work with several nodes; give a fixed port")
    elif backend == "etcd":
        etcd_members = tuple(_endpoint(t.strip(), ep_where, DEFAULT_ETCD_PORT)
                             for t in (endpoint_text or "localhost").split(",") if t.strip())
        if not etcd_members:
            raise UsageError(f"{ep_where}: no etcd endpoint given; use host:port[,host:port...]")
        rdzv_endpoint = etcd_members[0]
    else:
        rdzv_endpoint = _endpoint(endpoint_text or "localhost", ep_where, DEFAULT_C10D_PORT)
    if backend in ("c10d", "etcd"):
        if node_rank != 0:
            warnings.append(
                f"--node-rank is only used by the static backend; ignored with {backend}"
            )
        if ns.master_addr is not None or ns.master_port is not None:
            warnings.append(f"--master-addr/--master-port are only used by the static backend; "
                            f"ignored with {backend}")
    if rdzv_endpoint is not None and rdzv_endpoint.port == 0 and max_nodes > 1:
        raise UsageError(f"{ep_where}: port 0 (a free port only this node knows) cannot work "
                         f"with up to {max_nodes} nodes; give a fixed port")
    if not run_id or "/" in run_id:
        raise UsageError(f"{at('rdzv_id', '--rdzv-id')}: the job id must be non-empty and "
                         "contain no '/'")

    rdzv_conf = parse_rdzv_conf(ns.rdzv_conf or "", at("rdzv_conf", "--rdzv-conf"))
    if "is_host" in rdzv_conf and backend != "c10d":
        warnings.append(
            f"--rdzv-conf is_host is only used by the c10d backend; ignored with {backend}"
        )

    module = _flag_on(ns, "module", "--module")
    no_python = _flag_on(ns, "no_python", "--no-python")
    run_path = _flag_on(ns, "run_path", "--run-path")
    script: str = ns.training_script
    script_args: list[str] = list(ns.training_script_args)
    python = env.get("PYTHON_EXEC") or sys.executable
    if run_path:
        if no_python or module:
            warnings.append("--run-path takes precedence over --no-python and --module")
        entrypoint = [python, "-u", script, *script_args]
    elif no_python:
        if module:
            raise UsageError("--module and --no-python cannot be used together: -m runs a Python "
                             "module, --no-python runs a program; choose one")
        entrypoint = [script, *script_args]
    else:
        entrypoint = [python, "-u", *(["-m"] if module else []), script, *script_args]

    redirects = parse_std(ns.redirects or "0", at("redirects", "--redirects"))
    tee = parse_std(ns.tee or "0", at("tee", "--tee"))
    filters: dict[str, tuple[str, ...]] = {}
    for name, bit in (("stdout", Std.OUT), ("stderr", Std.ERR)):
        filters[name] = parse_filters(getattr(ns, f"duplicate_{name}_filters") or "")
        tees = tee.values() if isinstance(tee, dict) else [tee]
        if filters[name] and not any(t & bit for t in tees):
            warnings.append(f"--duplicate-{name}-filters copies tee'd lines only, and no rank's "
                            f"{name} is tee'd: add --tee {1 if bit == Std.OUT else 2} (or 3)")
    ranks_filter = parse_ranks(ns.local_ranks_filter or "", at("local_ranks_filter",
                                                               "--local-ranks-filter"))
    local_addr = (None if not ns.local_addr
                  else _host(ns.local_addr, at("local_addr", "--local-addr")))
    signals = parse_signals(ns.signals_to_handle or "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
                            at("signals_to_handle", "--signals-to-handle"))

    grace = _grace_period(ns, env, at)
    role = ns.role if ns.role is not None else "default"
    if not role.strip():
        raise UsageError("--role is empty: give the workers' role a name")

    token = ns.rdzv_token
    if token is not None and not isinstance(token, EnvText):
        warnings.append("--rdzv-token on the command line is visible to every user of this host "
                        "(ps); prefer the ELASTICTK_RDZV_TOKEN environment variable")

    config = LaunchConfig(
        min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc,
        rdzv_backend=backend, rdzv_endpoint=rdzv_endpoint, rdzv_path=rdzv_path, run_id=run_id,
        rdzv_conf=rdzv_conf, standalone=standalone,
        max_restarts=(0 if ns.max_restarts is None else parse_int(
            ns.max_restarts, at("max_restarts", "--max-restarts"), minimum=0)),
        monitor_interval=(0.1 if ns.monitor_interval is None else parse_seconds(
            ns.monitor_interval, at("monitor_interval", "--monitor-interval"))),
        start_method_given=ns.start_method is not None,
        start_method=parse_choice(ns.start_method or "spawn",
                                  at("start_method", "--start-method"), START_METHODS),
        role=role, entrypoint=entrypoint, training_script=script,
        training_script_args=script_args, module=module, no_python=no_python, run_path=run_path,
        log_dir=ns.log_dir or None,
        redirects=expand_std(redirects, nproc), tee=expand_std(tee, nproc),
        local_ranks_filter=ranks_filter, duplicate_stdout_filters=filters["stdout"],
        duplicate_stderr_filters=filters["stderr"], node_rank=node_rank, master_addr=master_addr,
        master_port=master_port, local_addr=local_addr, signals_to_handle=signals,
        virtual_local_rank=_flag_on(ns, "virtual_local_rank", "--virtual-local-rank"),
        grace_period=grace,
        log_line_prefix_template=env.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        recovery=parse_choice(ns.recovery or "restart-all", at("recovery", "--recovery"),
                              RECOVERY_MODES),
        collective_timeout=(None if ns.collective_timeout is None else parse_seconds(
            ns.collective_timeout, at("collective_timeout", "--collective-timeout"))),
        metrics_port=(None if ns.metrics_port is None
                      else parse_port(ns.metrics_port, at("metrics_port", "--metrics-port"))),
        metrics_host=(_host(ns.metrics_host, at("metrics_host", "--metrics-host"))
                      if ns.metrics_host else "127.0.0.1"),
        restart_intensity=(None if ns.restart_intensity is None else parse_intensity(
            ns.restart_intensity, at("restart_intensity", "--restart-intensity"))),
        restart_backoff=(0.0 if ns.restart_backoff is None else parse_seconds(
            ns.restart_backoff, at("restart_backoff", "--restart-backoff"), allow_zero=True)),
        rdzv_token=token or None, rdzv_endpoints=etcd_members, event_log=ns.event_log or None, warnings=tuple(warnings),
    )
    problems = validate(config)
    if problems:
        raise UsageError(problems[0])
    return config


def _grace_period(
    ns: argparse.Namespace, env: Mapping[str, str], at: Callable[[str, str], str]
) -> float:
    """``--grace-period`` and torch's ``--shutdown-timeout`` are one setting under two names."""
    given = {flag: parse_seconds(getattr(ns, dest), at(dest, flag), allow_zero=True)
             for dest, flag in (("grace_period", "--grace-period"),
                                ("shutdown_timeout", "--shutdown-timeout"))
             if getattr(ns, dest) is not None}
    if len(set(given.values())) > 1:
        raise UsageError("--grace-period and --shutdown-timeout are the same setting and "
                         "disagree; give one")
    if given:
        return next(iter(given.values()))
    raw = env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if raw:
        return parse_seconds(raw, f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={raw!r}", allow_zero=True)
    return DEFAULT_GRACE_PERIOD



"""Turn parsed ``elastictk-run`` flags into a :class:`LaunchConfig`, the way torchrun does.

torchrun spreads this over ``run()`` (``--standalone`` and its single-node default) and
``config_from_args()`` (types, entrypoint, warnings); here :func:`config_from_namespace` runs
one small function per concern over the parsed namespace (nodes and rendezvous in
:mod:`.nodes`), so every default, override and cross-check lives in one place. Values arrive as
text (:class:`EnvText` when they came from the environment) and are typed here, so each error
line names the flag or variable the bad value came from.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Mapping

from .config import DEFAULT_GRACE_PERIOD, LaunchConfig, validate
from ..snapshot.settings import SettingsError, parse_bytes, parse_every, parse_replicas, parse_tiers
from . import logs_specs
from .nodes import Flags, host, resolve_rendezvous
from .slurm import apply_slurm, slurm_flags
from .values import (
    DEFAULT_PROGRESS_TIMEOUT, HANG_MODES, MAX_COLLECTIVE_TIMEOUT, MAX_RESTART_BACKOFF, RECOVERY_MODES,
    START_METHODS, EnvText, Std,
    UsageError, expand_std, parse_bool, parse_choice, parse_filters, parse_int, parse_intensity, parse_port,
    parse_ranks, parse_seconds, parse_signals, parse_std,
)

PROG = "elastictk-run"
TOKEN_ENV = "ELASTICTK_RDZV_TOKEN"  # --rdzv-token's variable (the parser reads ELASTICTK_<DEST>)
DEFAULT_METRICS_LINGER = 60.0  # --metrics-linger with a fixed --metrics-port: a scrape or two
MAX_METRICS_LINGER = 3600.0


def config_from_namespace(
    ns: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> LaunchConfig:
    """Type, default and cross-check parsed flags the way torchrun's ``run``/``config_from_args``
    do; raises :class:`UsageError` on the first bad value.

    Each part below reads its own flags, in the order the checks run (so the first bad value
    met is the one reported): refused flags, nodes and rendezvous, the worker command, output,
    the node's process settings, restarts and timeouts, metrics.
    """
    c = Flags(ns, os.environ if environ is None else environ)
    _refuse_unsupported(c)
    node_id, notes = apply_slurm(c)  # under srun: rendezvous defaults from the job
    rdzv = resolve_rendezvous(c)
    parts = [rdzv.fields(), _entrypoint(c), _output(c, rdzv.nproc), _process(c), _restarts(c),
             _virtual_local_rank(c, rdzv.nproc), _event_log_handler(c),
             _metrics(c), _restart_policy(c), _snapshots(c), _stragglers(c), _exclusion(c),
             slurm_flags(c)]
    config = LaunchConfig(
        **{k: v for part in parts for k, v in part.items()},
        log_dir=ns.log_dir or None, event_log=ns.event_log or None,
        log_line_prefix_template=c.env.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        node_id=node_id, warnings=tuple(c.warnings), notes=tuple(notes),
    )
    problems = validate(config)
    if problems:
        raise UsageError(problems[0])
    return config


def _refuse_unsupported(c: Flags) -> None:
    """torchrun flags elastictk-run cannot honour here, refused by name: ``--numa-binding``
    binds each worker near the GPU its local rank names, so it needs CUDA."""
    mode = c.ns.numa_binding
    if mode:
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--numa-binding {mode}: binds each worker to the CPUs nearest the GPU its "
                             "LOCAL_RANK names, and torch sees no CUDA GPU on this host "
                             "(torch.cuda.is_available() is False); leave --numa-binding out")


def _event_log_handler(c: Flags) -> dict[str, Any]:
    """``--event-log-handler NAME``: a handler registered in torch's ``events.handlers`` (torch
    itself fails with a KeyError at its first event); ``null`` and ``console`` always are."""
    name = (c.ns.event_log_handler or "null").strip()
    if name not in ("null", "console"):
        from torch.distributed.elastic.events import handlers

        known = sorted(handlers._log_handlers)
        if name not in known:
            raise UsageError(f"{c.at('event_log_handler', '--event-log-handler')}: no torch event "
                             f"handler of that name is registered (known: {', '.join(known)}); "
                             "register it in torch.distributed.elastic.events.handlers before "
                             "the launch, or use --event-log PATH for a JSON-lines event log")
    return dict(event_log_handler=name)


def _entrypoint(c: Flags) -> dict[str, Any]:
    """The worker argv from the script, its args, and ``-m``/``--no-python``/``--run-path``."""
    module = c.on("module", "--module")
    no_python = c.on("no_python", "--no-python")
    run_path = c.on("run_path", "--run-path")
    script: str = c.ns.training_script
    script_args: list[str] = list(c.ns.training_script_args)
    python = c.env.get("PYTHON_EXEC") or sys.executable
    if run_path:
        if no_python or module:
            c.warnings.append("--run-path takes precedence over --no-python and --module")
        entrypoint = [python, "-u", script, *script_args]
    elif no_python:
        if module:
            raise UsageError("--module and --no-python cannot be used together: -m runs a Python "
                             "module, --no-python runs a program; choose one")
        entrypoint = [script, *script_args]
    else:
        entrypoint = [python, "-u", *(["-m"] if module else []), script, *script_args]
    if c.ns.numa_binding:  # each worker bound near its GPU first, as torchrun does (numabind.py)
        from ..supervisor.numabind import command

        entrypoint = command(c.ns.numa_binding, entrypoint, python)
    return dict(entrypoint=entrypoint, training_script=script, training_script_args=script_args,
                module=module, no_python=no_python, run_path=run_path)


def _output(c: Flags, nproc: int) -> dict[str, Any]:
    """Where the workers' output goes: ``--redirects``, ``--tee``, the filters."""
    ns = c.ns
    redirects = parse_std(ns.redirects or "0", c.at("redirects", "--redirects"))
    tee = parse_std(ns.tee or "0", c.at("tee", "--tee"))
    filters: dict[str, tuple[str, ...]] = {}
    for name, bit in (("stdout", Std.OUT), ("stderr", Std.ERR)):
        filters[name] = parse_filters(getattr(ns, f"duplicate_{name}_filters") or "")
        tees = tee.values() if isinstance(tee, dict) else [tee]
        if filters[name] and not any(t & bit for t in tees):
            c.warnings.append(f"--duplicate-{name}-filters copies tee'd lines only, and no "
                              f"rank's {name} is tee'd: add --tee {1 if bit == Std.OUT else 2} "
                              "(or 3)")
    ranks_filter = parse_ranks(ns.local_ranks_filter or "",
                               c.at("local_ranks_filter", "--local-ranks-filter"))
    _check_ranks_filter(c, ranks_filter, nproc)
    specs = None
    if ns.logs_specs:  # after the other log flags, as torch's config_from_args
        specs = logs_specs.build(ns.logs_specs, "--logs-specs", log_dir=ns.log_dir or None,
                                 redirects=redirects, tee=tee, local_ranks_filter=ranks_filter)
    return dict(redirects=expand_std(redirects, nproc), tee=expand_std(tee, nproc),
                local_ranks_filter=ranks_filter, duplicate_stdout_filters=filters["stdout"],
                duplicate_stderr_filters=filters["stderr"], logs_specs=specs)


def _check_ranks_filter(c: Flags, ranks: frozenset[int] | None, nproc: int) -> None:
    """A filtered rank past the node's last worker is a typo: it shows nothing, and when it
    is the only one, every worker's output is hidden without a word (torchrun accepts it)."""
    past = sorted(r for r in ranks or () if r >= nproc)
    if past:
        given = (c.at("nproc_per_node", "--nproc-per-node") if c.ns.nproc_per_node is not None
                 else f"--nproc-per-node {nproc}, the default")
        raise UsageError(
            f"{c.at('local_ranks_filter', '--local-ranks-filter')}: rank {past[0]} is not a local "
            f"rank of this node, which runs local ranks 0..{nproc - 1} "
            f"({given}); list ranks from 0 to {nproc - 1}"
        )


def _process(c: Flags) -> dict[str, Any]:
    """This node's address, the signals it forwards, the grace period, the role, the token."""
    ns = c.ns
    local_addr = (None if not ns.local_addr
                  else host(ns.local_addr, c.at("local_addr", "--local-addr")))
    signals = parse_signals(ns.signals_to_handle or "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
                            c.at("signals_to_handle", "--signals-to-handle"))
    grace = _grace_period(ns, c.env, c.at)
    role = ns.role if ns.role is not None else "default"
    if not role.strip():
        raise UsageError("--role is empty: give the workers' role a name")
    token = _token(ns.rdzv_token, c.env)
    if token is not None and not isinstance(token, EnvText):
        c.warnings.append("--rdzv-token on the command line is visible to every user of this "
                          "host (ps); prefer the ELASTICTK_RDZV_TOKEN environment variable")
    return dict(local_addr=local_addr, signals_to_handle=signals, grace_period=grace, role=role,
                rdzv_token=token or None)


def _token(token: str | None, env: Mapping[str, str]) -> str | None:
    """The job token; an empty (or blank) one is refused: it would run the job without any
    authentication while the user asked for it."""
    if token is None and env.get(TOKEN_ENV) is not None and not env[TOKEN_ENV].strip():
        raise UsageError(f"{TOKEN_ENV} is set but empty: the job would run without authentication; "
                         "set it to the job's secret token, or unset it to run without one")
    if token is not None and not token.strip():
        if isinstance(token, EnvText):
            raise UsageError(f"{token.env} is blank: the job would run without authentication; set "
                             "it to the job's secret token, or unset it to run without one")
        raise UsageError("--rdzv-token is empty: the job would run without authentication; give the "
                         f"job's secret token (prefer the environment variable {TOKEN_ENV}), or drop "
                         "the flag to run without one")
    return token


def _restarts(c: Flags) -> dict[str, Any]:
    """Restart budget, health checks, start method, recovery mode, collective timeout."""
    ns = c.ns
    if ns.monitor_interval is not None:
        c.warnings.append("--monitor-interval has no effect: a worker's exit wakes the agent at once "
                          "(pidfd), nothing polls; drop the flag")
    return dict(
        max_restarts=(0 if ns.max_restarts is None else parse_int(
            ns.max_restarts, c.at("max_restarts", "--max-restarts"), minimum=0)),
        monitor_interval=(0.1 if ns.monitor_interval is None else parse_seconds(
            ns.monitor_interval, c.at("monitor_interval", "--monitor-interval"))),
        start_method_given=ns.start_method is not None,
        start_method=parse_choice(ns.start_method or "spawn",
                                  c.at("start_method", "--start-method"), START_METHODS),
        recovery=parse_choice(ns.recovery or "restart-all", c.at("recovery", "--recovery"),
                              RECOVERY_MODES),
        standby=parse_choice(ns.standby or "0", c.at("standby", "--standby"), ("0", "1")) == "1",
        collective_timeout=(None if ns.collective_timeout is None else parse_seconds(
            ns.collective_timeout, c.at("collective_timeout", "--collective-timeout"),
            maximum=(MAX_COLLECTIVE_TIMEOUT, "(1 day): a collective stuck that long is a "
                     "hang; pass e.g. --collective-timeout 300"))),
        **_hangs(c),
        startup_timeout=_off_or_seconds(ns.startup_timeout, None,
                                        c.at("startup_timeout", "--startup-timeout")),
    )


def _virtual_local_rank(c: Flags, nproc: int) -> dict[str, Any]:
    """``--virtual-local-rank``: each worker sees one of ``CUDA_VISIBLE_DEVICES`` (or device
    ``local_rank``) as device 0, so there must be a listed device per worker (torch raises
    this when the workers start; here it is a usage error before anything starts)."""
    on = c.on("virtual_local_rank", "--virtual-local-rank")
    visible = c.env.get("CUDA_VISIBLE_DEVICES")
    if on and visible is not None and nproc > len(visible.split(",")):
        raise UsageError(f"--virtual-local-rank gives each of the {nproc} workers one device of "
                         f"CUDA_VISIBLE_DEVICES={visible!r}, which lists fewer; list one per "
                         "worker or lower --nproc-per-node")
    return dict(virtual_local_rank=on)


def _hangs(c: Flags) -> dict[str, Any]:
    """``--hang-detection`` and ``--progress-timeout``: under ``learned`` an unset timeout stays
    None (the learned deadlines' ceiling is then 300 s and a stall together is never killed);
    under ``fixed`` it defaults to 300 s as before."""
    ns = c.ns
    mode = parse_choice(ns.hang_detection or "learned", c.at("hang_detection", "--hang-detection"),
                        HANG_MODES)
    default = DEFAULT_PROGRESS_TIMEOUT if mode == "fixed" else None
    return dict(hang_detection=mode, progress_timeout=_off_or_seconds(
        ns.progress_timeout, default, c.at("progress_timeout", "--progress-timeout")))


def _off_or_seconds(raw: str | None, default: float | None, where: str) -> float | None:
    """A watchdog's seconds: ``default`` unless given, 0 for off (None)."""
    if raw is None:
        return default
    value = parse_seconds(raw, where, allow_zero=True,
                          maximum=(MAX_COLLECTIVE_TIMEOUT, "(1 day); 0 turns it off"))
    return value or None


def _metrics(c: Flags) -> dict[str, Any]:
    ns = c.ns
    port = (None if ns.metrics_port is None
            else parse_port(ns.metrics_port, c.at("metrics_port", "--metrics-port")))
    return dict(
        metrics_port=port,
        metrics_host=(host(ns.metrics_host, c.at("metrics_host", "--metrics-host"))
                      if ns.metrics_host else "127.0.0.1"),
        metrics_linger=_metrics_linger(c, port),
    )


def _metrics_linger(c: Flags, port: int | None) -> float:
    """``--metrics-linger``: how long a failed job's exporter waits for a scrape, so an alert on
    ``state="failed"`` can fire. By default a minute for a fixed port (a scrape config names
    it) and none for port 0 (no scrape config can name a port picked at random)."""
    where = c.at("metrics_linger", "--metrics-linger")
    if c.ns.metrics_linger is None:
        return DEFAULT_METRICS_LINGER if port else 0.0
    if port is None:
        raise UsageError(f"{where} keeps the metrics exporter up, and there is none: add "
                         "--metrics-port PORT or leave --metrics-linger out")
    return parse_seconds(c.ns.metrics_linger, where, allow_zero=True,
                         maximum=(MAX_METRICS_LINGER, "(an hour); pass e.g. --metrics-linger 60"))


def _restart_policy(c: Flags) -> dict[str, Any]:
    """``--restart-intensity``, ``--restart-backoff`` and ``--max-no-progress-restarts``."""
    ns = c.ns
    return dict(
        restart_intensity=(None if ns.restart_intensity is None else parse_intensity(
            ns.restart_intensity, c.at("restart_intensity", "--restart-intensity"))),
        restart_backoff=(0.0 if ns.restart_backoff is None else parse_seconds(
            ns.restart_backoff, c.at("restart_backoff", "--restart-backoff"), allow_zero=True,
            maximum=(MAX_RESTART_BACKOFF, "(the backoff doubles from it up to 60 s); pass "
                     "e.g. --restart-backoff 1"))),
        max_no_progress_restarts=(0 if ns.max_no_progress_restarts is None else parse_int(
            ns.max_no_progress_restarts,
            c.at("max_no_progress_restarts", "--max-no-progress-restarts") + " (0 turns it off)",
            minimum=0)),
        health_check=_health_check(ns.health_check, c.at("health_check", "--health-check")),
        health_interval=(60.0 if ns.health_interval is None else parse_seconds(
            ns.health_interval, c.at("health_interval", "--health-interval"),
            maximum=(86400.0, "(a day); pass e.g. --health-interval 60"))),
    )


def _stragglers(c: Flags) -> dict[str, Any]:
    """``--straggler-action``, ``--straggler-threshold``, ``--straggler-windows``,
    ``--straggler-interval`` (docs/launcher.md "Stragglers")."""
    ns = c.ns
    where = c.at("straggler_action", "--straggler-action")
    action = parse_choice(ns.straggler_action or "off", where, ("off", "report", "exclude"))
    threshold = 1.5
    if ns.straggler_threshold is not None:
        at = c.at("straggler_threshold", "--straggler-threshold")
        try:
            threshold = float(ns.straggler_threshold)
        except ValueError:
            threshold = float("nan")
        if not 1 < threshold < 1e6:
            raise UsageError(f"{at} {ns.straggler_threshold!r}: must be a number more than 1 (times "
                             "slower than the others), e.g. --straggler-threshold 1.5")
    return dict(
        straggler_action=action, straggler_threshold=threshold,
        straggler_windows=(3 if ns.straggler_windows is None else parse_int(
            ns.straggler_windows, c.at("straggler_windows", "--straggler-windows"), minimum=1)),
        straggler_interval=(5.0 if ns.straggler_interval is None else parse_seconds(
            ns.straggler_interval, c.at("straggler_interval", "--straggler-interval"),
            maximum=(3600.0, "(an hour); pass e.g. --straggler-interval 5"),
            minimum=(0.1, "(each check reads every rank's pace; a shorter interval only spins "
                          "the agent); pass e.g. --straggler-interval 5"))),
    )


def _exclusion(c: Flags) -> dict[str, Any]:
    """``--exclude-after R/T`` and ``--exclude-cooldown S`` (docs/launcher.md "Bad hosts")."""
    ns = c.ns
    after = None
    if ns.exclude_after is not None:
        where = c.at("exclude_after", "--exclude-after")
        if "/" not in ns.exclude_after:
            raise UsageError(f"{where}: write R/T, e.g. 3/60 to exclude a node whose workers fail 3 times "
                             "within 60 seconds")
        r, t = parse_intensity(ns.exclude_after, where)
        if r < 1 or t > 30 * 86400:
            raise UsageError(f"{where}: need R >= 1 failures and T at most 2592000 "
                             "seconds (30 days), e.g. 3/60")
        after = (r, t)
    cooldown = (300.0 if ns.exclude_cooldown is None else parse_seconds(
        ns.exclude_cooldown, c.at("exclude_cooldown", "--exclude-cooldown"),
        maximum=(7 * 86400.0, "(a week); pass e.g. --exclude-cooldown 300")))
    stragglers = ns.straggler_action == "exclude"
    if (after is not None or stragglers) and (ns.recovery or "restart-all") == "in-place":
        raise UsageError("--exclude-after and --straggler-action exclude work with --recovery restart-all "
                         "only (in place, a failed worker is replaced, not counted); drop one of them")
    if ns.exclude_cooldown is not None and after is None and not stragglers:
        c.warnings.append("--exclude-cooldown has no effect without --exclude-after R/T or "
                          "--straggler-action exclude")
    return dict(exclude_after=after, exclude_cooldown=cooldown)


def _health_check(raw: str | None, where: str) -> str | None:
    if raw is None:
        return None
    if not raw.strip():
        raise UsageError(f"{where}: empty; give a command, e.g. --health-check 'nvidia-smi -L'")
    return raw


def _snapshots(c: Flags) -> dict[str, Any]:
    """``--snapshot``, ``--snapshot-dir``, ``--snapshot-every``, ``--snapshot-memory`` and the
    peer tier's ``--snapshot-replicas`` and ``--snapshot-replica-memory``."""
    ns = c.ns
    try:
        tiers = (parse_tiers(ns.snapshot, c.at("snapshot", "--snapshot"))
                 if ns.snapshot is not None else ())
        directory = ns.snapshot_dir or None
        if directory and not tiers:
            tiers = ("disk",)
        every = (10 if ns.snapshot_every is None
                 else parse_every(ns.snapshot_every, c.at("snapshot_every", "--snapshot-every")))
        memory = (None if ns.snapshot_memory is None
                  else parse_bytes(ns.snapshot_memory, c.at("snapshot_memory", "--snapshot-memory")))
        overlap = (ns.snapshot_overlap is not None
                   and parse_bool(ns.snapshot_overlap, c.at("snapshot_overlap", "--snapshot-overlap")))
        replicas = (1 if ns.snapshot_replicas is None
                    else parse_replicas(ns.snapshot_replicas, c.at("snapshot_replicas", "--snapshot-replicas")))
        replica_memory = (None if ns.snapshot_replica_memory is None
                          else parse_bytes(ns.snapshot_replica_memory,
                                           c.at("snapshot_replica_memory", "--snapshot-replica-memory")))
    except SettingsError as e:
        raise UsageError(str(e)) from None
    if ns.snapshot_every is not None and "disk" not in tiers:
        c.warnings.append("--snapshot-every applies to the disk tier, which is off: add "
                          "--snapshot-dir DIR")
    if memory is not None and "local" not in tiers:
        c.warnings.append("--snapshot-memory bounds the local tier, which is off: add --snapshot local")
    if ns.snapshot_replicas is not None and "peer" not in tiers:
        c.warnings.append("--snapshot-replicas applies to the peer tier, which is off: add --snapshot local,peer")
    if replica_memory is not None and "peer" not in tiers:
        c.warnings.append("--snapshot-replica-memory bounds the peer tier's replicas, and the peer tier is off: "
                          "add --snapshot local,peer")
    if overlap and not tiers:
        c.warnings.append("--snapshot-overlap pipelines snapshot commits, and no tier is on: add "
                          "--snapshot local")
    if directory:
        directory = os.path.abspath(directory)
    return dict(snapshot=tiers, snapshot_dir=directory, snapshot_every=every, snapshot_memory=memory,
                snapshot_overlap=overlap, snapshot_replicas=replicas, snapshot_replica_memory=replica_memory)


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



"""The Slurm part of :func:`~elastictk.cli.resolve.config_from_namespace`: under ``srun``, the
rendezvous flags not given are taken from the job (:mod:`elastictk.slurm.defaults`).

Runs before the nodes and rendezvous are resolved, filling the parsed namespace as if the
values had been typed, so the same checks judge them; a flag given (or a ``PET_*`` variable
set) is never replaced. A malformed Slurm variable is a :class:`UsageError` (exit 2).
"""
from __future__ import annotations

import signal
from typing import Any, Callable

from ..slurm import SlurmEnvError, job_id, launch_defaults, read, scontrol_hostnames, this_node
from ..slurm.env import outside_srun
from .nodes import Flags
from .values import UsageError, parse_signals

_GIVEN = ("nnodes", "rdzv_id", "rdzv_backend", "rdzv_endpoint", "standalone", "master_addr",
          "master_port")


def apply_slurm(c: Flags, hostnames: Callable[[str], list[str] | None] = scontrol_hostnames,
                ) -> tuple[str | None, list[str]]:
    """Fill ``c.ns`` from Slurm; returns (this node's id or None, the lines to print)."""
    try:
        job = read(c.env, hostnames)
    except SlurmEnvError as e:
        raise UsageError(f"{e}") from None
    if job is None:
        alone = outside_srun(c.env)  # a batch script's elastictk-run: one node, said once
        if alone is not None:
            c.warnings.append(alone)
        return None, []
    ns = c.ns
    defaults = launch_defaults(job, {d: getattr(ns, d) for d in _GIVEN})
    if defaults is None:
        return None, []
    if defaults.problem is not None:
        raise UsageError(defaults.problem)
    for dest, value in defaults.values.items():
        if dest == "is_host":
            conf = ns.rdzv_conf or ""
            if "is_host" not in conf:
                ns.rdzv_conf = f"{conf},is_host={value}" if conf.strip() else f"is_host={value}"
        else:
            setattr(ns, dest, value)
    if job.disagreement is not None:
        c.warnings.append(job.disagreement)
    return defaults.node_id, [defaults.line]


#: Signals the agent can take as "pre-empted": the ones it handles (it stops the workers on
#: the first three, forwards the others).
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_OFF = ("off", "none", "0")


def slurm_flags(c: Flags) -> dict[str, Any]:
    """``--preempt-signal`` (default SIGUSR1 under Slurm, else off), ``--requeue``,
    ``--slurm-drain``."""
    ns = c.ns
    in_slurm = bool(c.env.get("SLURM_JOB_ID"))
    where = c.at("preempt_signal", "--preempt-signal")
    raw = ns.preempt_signal
    sig: signal.Signals | None = signal.SIGUSR1 if in_slurm else None
    if raw is not None:
        if raw.strip().lower() in _OFF:
            sig = None
        else:
            sigs = parse_signals(raw, where)
            if len(sigs) != 1 or sigs[0] not in PREEMPT_SIGNALS:
                raise UsageError(f"{where}: give one of {', '.join(s.name for s in PREEMPT_SIGNALS)} "
                                 "(the signal sbatch --signal sends, e.g. --signal=USR1@120), or off")
            sig = sigs[0]
    requeue = c.on("requeue", "--requeue")
    drain = c.on("slurm_drain", "--slurm-drain")
    if requeue and sig is None:
        raise UsageError("--requeue requeues the job when it is pre-empted, and --preempt-signal is "
                         "off: give --preempt-signal USR1 (the signal of sbatch --signal) or drop --requeue")
    for on, flag, what in ((requeue, "--requeue", "requeue"), (drain, "--slurm-drain", "drain")):
        if on and not in_slurm:
            c.warnings.append(f"{flag} asks Slurm to {what}, and this is not a Slurm job (no "
                              "SLURM_JOB_ID): nothing will be asked")
    _check_scontrol_args(c, requeue and in_slurm, drain and in_slurm and bool(c.env.get("SLURMD_NODENAME")))
    if drain and in_slurm and not c.env.get("SLURMD_NODENAME"):
        c.warnings.append("--slurm-drain drains this node by its Slurm name, and SLURMD_NODENAME is not "
                          "set (run elastictk-run under srun): nothing will be drained")
    if drain and ns.exclude_after is None and ns.health_check is None:
        c.warnings.append("--slurm-drain drains a node excluded by --exclude-after or failing "
                          "--health-check, and neither is given: nothing will be drained")
    return dict(preempt_signal=sig, requeue=requeue, slurm_drain=drain)


def _check_scontrol_args(c: Flags, requeue: bool, drain: bool) -> None:
    """What ``--requeue`` and ``--slurm-drain`` would hand to scontrol, checked now (in a job
    step or an sbatch batch step alike): a bad one is one line, exit 2, not a later
    ``scontrol requeue 4242,4243`` or ``NodeName=ALL``."""
    for on, flag, read_it in ((requeue, "--requeue", job_id), (drain, "--slurm-drain", this_node)):
        if on:
            try:
                read_it(c.env)
            except SlurmEnvError as e:
                raise UsageError(f"{flag}: {e}") from None

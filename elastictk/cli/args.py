"""``elastictk-run``'s argument parser: torchrun's flags, spellings, defaults and ``PET_*`` env.

torchrun reads each flag from the command line, else from ``PET_<DEST>`` (``PET_NNODES``,
``PET_NPROC_PER_NODE``...), else its default; elastictk's own flags read ``ELASTICTK_<DEST>``.
The parser only collects text, remembering which values came from the environment
(:class:`EnvText`); :func:`~elastictk.cli.resolve.config_from_namespace` turns them into a
:class:`LaunchConfig`, so every bad value is reported as one line naming the flag or variable it
came from.

``elastictk.run.main(argv)`` is meant to be: ``config = parse_or_exit(argv)``, build the agent,
run it.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
from contextlib import redirect_stderr, redirect_stdout
from typing import Any, Mapping, NoReturn, Sequence

from .config import LaunchConfig, check_system
from .resolve import PROG, config_from_namespace
from .values import HANG_MODES, RECOVERY_MODES, START_METHODS, ArgvError, EnvText, UsageError

class _Parser(argparse.ArgumentParser):
    """Raises :class:`UsageError` instead of printing usage and exiting, so callers decide."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("the following arguments are required"):
            message = f"no training script given: {PROG} [flags] SCRIPT [ARGS...]"
        raise ArgvError(f"{message} (see {PROG} --help)")


class _Flag(argparse.Action):
    """A switch: present means on; absent falls back to its env value (torch's ``check_env``)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, True)


# (flags, is_switch, help). Every value is read as text; config_from_namespace types it.
_TORCH_FLAGS: list[tuple[tuple[str, ...], bool, str]] = [
    (("--nnodes",), False, "number of nodes, N or MIN:MAX (default 1:1)"),
    (("--nproc-per-node", "--nproc_per_node"), False,
     "workers per node: a number, cpu, gpu or auto (default 1)"),
    (("--rdzv-backend", "--rdzv_backend"), False,
     "rendezvous backend: c10d, etcd (etcd-v2), file or static (default static)"),
    (("--rdzv-endpoint", "--rdzv_endpoint"), False,
     "rendezvous endpoint HOST[:PORT] (c10d default port 29400, etcd 2379), or a PATH for file"),
    (("--rdzv-id", "--rdzv_id"), False, "job id shared by all nodes (default none)"),
    (("--rdzv-conf", "--rdzv_conf"), False,
     "rendezvous settings k=v,...: join_timeout, last_call_timeout, close_timeout, timeout, "
     "read_timeout, is_host, heartbeat_interval, heartbeat_timeout"),
    (("--standalone",), True,
     "single node: a c10d store of its own on a free loopback port (records sealed with a "
     "random per-run token: any local user can reach it) and a random id; overrides "
     "--rdzv-backend/--rdzv-endpoint/--rdzv-id"),
    (("--max-restarts", "--max_restarts"), False,
     "worker group restarts before failing (default 0)"),
    (("--monitor-interval", "--monitor_interval"), False,
     "accepted for torchrun's sake, without effect: a worker's exit is noticed at once "
     "(pidfd), nothing polls"),
    (("--start-method", "--start_method"), False,
     f"how workers start: {', '.join(START_METHODS)} (default: Python scripts are forked "
     "from the preload server, other programs spawned; spawn, fork and forkserver each start "
     "a fresh interpreter, as torchrun)"),
    (("--event-log-handler", "--event_log_handler"), False,
     "torch's event handler name; only 'null' is accepted: use --event-log PATH"),
    (("--role",), False, "user-defined role of the workers (default 'default')"),
    (("-m", "--module"), True, "run the script as a module, like python -m"),
    (("--no-python", "--no_python"), True, "run the script as a program, without python"),
    (("--run-path", "--run_path"), True,
     "run the script with runpy.run_path; takes precedence over --no-python"),
    (("--log-dir", "--log_dir"), False, "base directory for worker log files"),
    (("-r", "--redirects"), False,
     "streams to log files only: 0 none, 1 out, 2 err, 3 both, or per rank 0:1,1:2"),
    (("-t", "--tee"), False, "streams to log files and console (forms as --redirects)"),
    (("--local-ranks-filter", "--local_ranks_filter"), False,
     "only show these local ranks on the console, e.g. 0,1"),
    (("--duplicate-stdout-filters", "--duplicate_stdout_filters"), False,
     "also copy tee'd stdout lines holding any of these strings (a,b; ',,' is a comma) to "
     "filtered_stdout.log in the attempt's log dir"),
    (("--duplicate-stderr-filters", "--duplicate_stderr_filters"), False,
     "the same for stderr, to filtered_stderr.log"),
    (("--node-rank", "--node_rank"), False, "this node's rank (static backend only; default 0)"),
    (("--master-addr", "--master_addr"), False, "master host (static backend; default 127.0.0.1)"),
    (("--master-port", "--master_port"), False, "master port (static backend; default 29500)"),
    (("--local-addr", "--local_addr"), False, "this node's address as peers see it"),
    (("--signals-to-handle", "--signals_to_handle"), False,
     "signals that stop the job: sent to the workers, then exit 128+N (default "
     "SIGTERM,SIGINT,SIGHUP,SIGQUIT, torchrun's; also given to workers as "
     "TORCHELASTIC_SIGNALS_TO_HANDLE); SIGTERM, SIGINT, SIGHUP always stop it, and SIGUSR1, "
     "SIGUSR2 not listed are forwarded while the job runs on (docs/launcher.md)"),
    (("--shutdown-timeout", "--shutdown_timeout"), False,
     "seconds from SIGTERM to SIGKILL when stopping workers (default "
     "TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30); same as --grace-period"),
    (("--virtual-local-rank", "--virtual_local_rank"), True,
     "LOCAL_RANK=0 in every worker, each seeing only its own GPU"),
]
# torchrun flags without an env fallback (torch adds them with plain actions).
_TORCH_NO_ENV = (("--numa-binding", "--numa_binding"),)

_OWN_FLAGS: list[tuple[tuple[str, ...], bool, str]] = [
    (("--recovery",), False,
     f"on a worker failure: {' or '.join(RECOVERY_MODES)} (default restart-all)"),
    (("--standby",), False,
     "in-place recovery: keep one warmed standby process per node that a replaced worker "
     "becomes, 1 or 0 (default 0)"),
    (("--collective-timeout",), False, "seconds before a stuck collective counts as a hang"),
    (("--hang-detection",), False,
     f"{' | '.join(HANG_MODES)}: how a hung rank is found. learned: no progress (steps, "
     "collectives, sections) past a deadline learned from the job's own pace while a peer "
     "waits in a collective; fixed: no optimizer step for --progress-timeout; off (default "
     "learned; docs/timers.md)"),
    (("--progress-timeout",), False,
     "seconds; under --hang-detection learned the learned deadlines' ceiling, and the only "
     "limit that kills ranks stalled together outside a collective (default: 300 as ceiling, "
     "never kills a stall); under fixed, seconds without a step of some rank before the group "
     "counts as hung (default 300); 0 off"),
    (("--startup-timeout",), False,
     "seconds a rank may take to complete its first step before it counts as hung "
     "(default 0: off)"),
    (("--metrics-port",), False, "serve Prometheus metrics on this port (0: any free port)"),
    (("--metrics-host",), False, "address for the metrics server (default 127.0.0.1)"),
    (("--metrics-linger",), False,
     "when the job fails, keep serving metrics until one scrape has seen state=\"failed\" or "
     "this many seconds pass (Ctrl-C ends the wait) (default 60 with a fixed --metrics-port, "
     "0 with port 0)"),
    (("--restart-intensity",), False, "R/T: give up after more than R restarts in T seconds"),
    (("--health-check",), False,
     "command (sh -c) run before this node joins each round and every --health-interval in "
     "it; a non-zero exit keeps the node out (or takes it out), up to the join timeout "
     "(default none)"),
    (("--health-interval",), False, "seconds between health checks (default 60)"),
    (("--straggler-action",), False,
     "off, report (name a rank the others wait for: event, gauge, log line) or exclude (report, "
     "and take its node out of the job for --exclude-cooldown) (default off)"),
    (("--straggler-threshold",), False,
     "times slower than the other ranks' median own time per step that counts (default 1.5)"),
    (("--straggler-windows",), False,
     "windows in a row past the threshold before a rank is named (default 3)"),
    (("--straggler-interval",), False, "seconds per straggler window (default 5)"),
    (("--exclude-after",), False,
     "R/T: a node whose workers fail R times within T seconds is taken out of the job for "
     "--exclude-cooldown (so is one whose --health-check fails in a round) (default off)"),
    (("--exclude-cooldown",), False,
     "seconds an excluded node stays out before it rejoins (default 300)"),
    (("--max-no-progress-restarts",), False,
     "K: end the job after K restarts in a row after which no rank completed a step (a crash "
     "loop), whatever --max-restarts has left (default 0: off)"),
    (("--restart-backoff",), False, "seconds to wait before restarting workers (default 0)"),
    (("--grace-period",), False, "seconds from SIGTERM to SIGKILL (default 30)"),
    (("--rdzv-token",), False,
     "shared secret nodes must present to join (prefer env ELASTICTK_RDZV_TOKEN: argv is public)"),
    (("--event-log",), False, "append JSON-lines events to this file"),
    (("--snapshot",), False,
     "snapshot tiers of elastictk.State commits, comma separated: local (shared memory owned by "
     "this agent), peer (also in other nodes' agents; implies local), disk (default none)"),
    (("--snapshot-replicas",), False,
     "peer tier: how many other nodes hold each node's parts (default 1)"),
    (("--snapshot-dir",), False,
     "directory of the disk tier, seen by every node (alone: --snapshot disk)"),
    (("--snapshot-every",), False, "write the disk tier every N commits (default 10)"),
    (("--snapshot-overlap",), False,
     "1: pipelined commits, the tensors an optimizer owns are copied while the next step's "
     "forward and backward run (its step waits for the copy); 0: copied in commit() "
     "(default 0)"),
    (("--snapshot-memory",), False,
     "bytes of shared memory the local tier may use on this node, all local ranks, e.g. 4G "
     "(default a quarter of the host's memory; used only as written)"),
    (("--snapshot-replica-memory",), False,
     "bytes the peer tier's replicas of other nodes' parts may map on this node, kept and "
     "arriving (default --snapshot-memory: room for a whole replica while its successor arrives, "
     "4x the state per node); sized for one replica (3x) a replica goes before its successor "
     "arrives, and a node lost mid-send loses its state there (docs/snapshots.md)"),
    (("--preempt-signal",), False,
     "the signal that means the job is pre-empted (sbatch --signal=USR1@120): forwarded to the "
     "workers, which get --grace-period to end, then stopped; exit 75 (default USR1 under "
     "Slurm, else off; 'off' turns it off) (docs/slurm.md)"),
    (("--requeue",), True,
     "when pre-empted, ask Slurm to requeue the job (scontrol requeue $SLURM_JOB_ID)"),
    (("--slurm-drain",), True,
     "drain this node in Slurm (scontrol update NodeName=... State=DRAIN) when --exclude-after "
     "excludes it or its --health-check fails"),
]


def _dest(flags: Sequence[str]) -> str:
    long = next(f for f in flags if f.startswith("--"))
    return long[2:].replace("-", "_")


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The parser, with env-derived defaults read from ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    parser = _Parser(
        prog=PROG,
        description="Fault-tolerant, elastic drop-in for torchrun: same flags, same worker env.",
    )
    for group, prefix in ((_TORCH_FLAGS, "PET_"), (_OWN_FLAGS, "ELASTICTK_")):
        for flags, switch, help_text in group:
            dest = _dest(flags)
            name = prefix + dest.upper()
            raw = env.get(name)
            default: Any = EnvText(raw, name) if raw else (False if switch else None)
            if switch:
                parser.add_argument(*flags, action=_Flag, dest=dest, default=default, help=help_text)
            else:
                parser.add_argument(*flags, dest=dest, default=default, help=help_text)
    parser.add_argument("--logs-specs", "--logs_specs", dest="logs_specs", default=None,
                        help="a LogsSpecs class by its torchrun.logs_specs entry-point name: "
                             "it decides where the workers' logs go")
    for flags in _TORCH_NO_ENV:  # torchrun's, no env fallback: CPU binding near each worker's GPU
        parser.add_argument(*flags, dest=_dest(flags), default=None,
                            choices=["node", "socket", "exclusive", "core-complex"],
                            help="bind each worker to the CPUs near the GPU its LOCAL_RANK names "
                                 "(torch.numa.binding's choice, as torchrun); needs CUDA")
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}",
                        help="print elastictk's version and exit")
    parser.add_argument("training_script", help="the script (or module, or program) to run")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER,
                        help="arguments passed on to the script")
    return parser


def parse_args(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    check: bool = True,
) -> LaunchConfig:
    """argv (default ``sys.argv[1:]``) to a validated :class:`LaunchConfig`.

    Raises :class:`UsageError` (one line) on bad input. ``check=False`` skips
    :func:`check_system` (script on disk, program on PATH, ports free), for building a config
    that will run elsewhere.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser(environ).parse_args(args)
    config = config_from_namespace(ns, environ)
    if check:
        check_system(config)
    return config


def parse_or_exit(argv: Sequence[str] | None = None,
                  environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """:func:`parse_args` for a ``main``: prints warnings, and on bad input prints
    ``elastictk-run: error: <line>`` to stderr and exits 2, argparse-style, with no traceback."""
    try:
        config = parse_args(argv, environ)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for line in config.notes:
        print(f"{PROG}: {line}", file=sys.stderr)
    for line in config.warnings:
        print(f"{PROG}: warning: {line}", file=sys.stderr)
    return config


def main_for_test(argv: Sequence[str], environ: Mapping[str, str] | None = None,
                  ) -> tuple[int, str, LaunchConfig | None]:
    """Run :func:`parse_or_exit` in-process: ``(exit code, stderr text, config or None)``."""
    err, out = io.StringIO(), io.StringIO()
    try:
        with redirect_stderr(err), redirect_stdout(out):
            config = parse_or_exit(argv, environ)
    except SystemExit as e:
        return (e.code if isinstance(e.code, int) else 1), err.getvalue(), None
    return 0, err.getvalue(), config

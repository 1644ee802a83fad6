"""``elastictk-run`` (and ``python -m elastictk.run``): torchrun's command line on elastictk's parts.

``main(argv)`` parses torchrun's flags into a :class:`LaunchConfig`, opens (or hosts) the
rendezvous store, and runs one :class:`ElasticAgent` for this node. Exit codes: 0 when the job
finished, 1 when it failed (the root cause is printed; a node that arrives after its job ended
runs nothing and exits with the job's outcome), 2 for bad input (a flag's value, or a
rendezvous store, event log or metrics port that cannot be opened with it), 75 when it was
pre-empted (``--preempt-signal``: run the job again), 128+N when the agent was stopped by
signal N.
"""
from __future__ import annotations

import os
import signal
import sys


def _interrupted_while_starting(signum: int, frame: object) -> None:
    """Ctrl-C before the agent takes SIGINT over (imports, torch's, the store's wait): one line
    and 130, not a KeyboardInterrupt traceback from deep in an import (one inside numpy's C
    extension even turned into an ImportError). No worker runs yet; what was started dies
    with this process (the preload server by its death signal, sockets with their fds)."""
    os.write(2, b"elastictk-run: interrupted (Ctrl-C) while starting; the job did not run\n")
    os._exit(130)


if ((__name__ == "__main__" or os.path.basename(sys.argv[0]) == "elastictk-run")
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
    signal.signal(signal.SIGINT, _interrupted_while_starting)  # a library caller's stays its own

import logging  # noqa: E402 - after the handler: these imports are the window it covers
from typing import TYPE_CHECKING, Sequence  # noqa: E402

from .cli import LaunchConfig, parse_or_exit  # noqa: E402
from .cli.args import PROG  # noqa: E402

log = logging.getLogger("elastictk.run")


class _CallerStderr(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is at each record, so a library caller of ``main()`` who
    redirects it (``contextlib.redirect_stderr``, pytest's ``capsys``) gets the agent's lines."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def _setup_logging() -> None:
    root = logging.getLogger("elastictk")
    if not root.handlers:
        h = _CallerStderr()
        h.setFormatter(logging.Formatter(f"[{PROG}] %(message)s"))
        root.addHandler(h)
    root.setLevel(os.environ.get("ELASTICTK_LOG_LEVEL", "INFO").upper())


def main(argv: Sequence[str] | None = None, *, exits: bool = False) -> int:
    """Run one node of a job, as ``torch.distributed.run.main`` does for a library caller.

    Raises where torch raises: bad flags exit through argparse (``SystemExit(2)``), a bad
    configuration raises ``ValueError`` (:class:`~elastictk.cli.UsageError`), workers that
    failed raise :class:`WorkersFailed` (a ``ChildFailedError`` whose message is elastictk's
    root-cause report), and a terminating signal raises torch's ``SignalException``. Returns 0
    when the job finished. ``exits`` (``console_main``): print one line and return the exit
    code instead of raising, and let the caller end the process with ``os._exit`` at once.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    config = parse_or_exit(args) if exits else _parse_or_raise(args)
    if not _hosts_resolve(config, raises=not exits):
        return 2
    _setup_logging()
    from .agent.launch import start_preload  # before any thread: the server is forked from here

    server = start_preload(config)
    try:
        result = _run(config, server, join_watchers=not exits)
    finally:
        if server is not None:
            server.close()
    if result is None:  # the store or the telemetry could not be opened: a flag's value
        return 2
    if result.report is not None:
        from .supervisor.report_text import render_text

        print(render_text(result.report), file=sys.stderr)
    level = logging.INFO if result.exit_code == 0 else logging.ERROR
    if result.state == "preempted":
        level = logging.WARNING
        if config.requeue:
            _requeue()
    if result.recovery_summary:  # where the job's recoveries spent their time
        log.log(level, "%s", result.recovery_summary)
    log.log(level, "%s (exit %d): %s", result.state, result.exit_code, result.message)
    if result.exit_code != 0 and not exits:
        raise _exception_for(config, result)
    return result.exit_code


def _requeue() -> None:
    """``--requeue`` after a pre-emption: one node asks Slurm (task 0 of the step, so the job is
    not requeued once per node); how it went is one line, and the exit code stays 75."""
    from .slurm import SlurmEnvError, job_id, requeue

    if not os.environ.get("SLURM_JOB_ID"):
        log.warning("--requeue: not a Slurm job (no SLURM_JOB_ID); nothing asked")
        return
    try:
        job = job_id(os.environ)
    except SlurmEnvError as e:
        log.warning("--requeue: %s", e)
        return
    task = os.environ.get("SLURM_PROCID", "0")
    if task != "0":
        log.info("--requeue: task 0 of the step asks Slurm to requeue job %s (this is task %r)", job, task[:20])
        return
    answer = requeue(job)
    log.log(logging.INFO if answer.ok else logging.WARNING, "%s", answer.line)


def _hosts_resolve(config: LaunchConfig, *, raises: bool) -> bool:
    """The rendezvous host names resolve; else one line and False (``raises``: the
    :class:`~elastictk.cli.UsageError` raised, as for a bad configuration). Checked here, where
    the store is about to be opened, not in ``parse_args``: a config may be built for a host
    whose names only resolve there."""
    from .cli import UsageError
    from .cli.preflight import check_endpoint_hosts

    try:
        check_endpoint_hosts(config)
    except UsageError as e:
        if raises:
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return False
    return True


def _await_store_host(config: LaunchConfig) -> None:
    """Under Slurm's defaults, a node that does not host the c10d store waits (up to the join
    timeout) for the one that does: every task of the step starts at once."""
    if config.node_id is None or config.is_host is not False or config.rdzv_endpoint is None:
        return
    from .slurm.wait import wait_for_store

    wait_for_store(config.rdzv_endpoint, float(config.rdzv_conf.get("join_timeout", 600.0)),
                   lambda line: log.info("%s", line))


def _slurm_drain(config: LaunchConfig, agent_config: "AgentConfig") -> None:
    """``--slurm-drain``: the agent's events drain this node (SLURMD_NODENAME) in Slurm."""
    if not config.slurm_drain or not os.environ.get("SLURMD_NODENAME"):
        return  # outside Slurm --slurm-drain was already said to do nothing
    from .agent.slurm_drain import drain_on_exclusion
    from .slurm import SlurmEnvError, this_node

    try:  # checked at start too (exit 2); a library caller's config may skip that
        node = this_node(os.environ)
    except SlurmEnvError as e:
        log.warning("--slurm-drain: %s", e)
        return

    agent_config.on_event = drain_on_exclusion(node, agent_config.on_event)


def _parse_or_raise(argv: list[str]) -> LaunchConfig:
    """A library caller's parse: warnings printed, a bad configuration raised (a ValueError)."""
    from .cli import parse_args
    from .cli.values import ArgvError

    try:
        config = parse_args(argv)
    except ArgvError as e:  # argparse's own refusals exit 2, as torch's main does
        print(f"{PROG}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for line in config.notes:
        print(f"{PROG}: {line}", file=sys.stderr)
    for line in config.warnings:
        print(f"{PROG}: warning: {line}", file=sys.stderr)
    return config


def parse_min_max_nnodes(nnodes: str) -> tuple[int, int]:
    """torchrun's ``parse_min_max_nnodes``: ``"N"`` or ``"MIN:MAX"`` as ``(min, max)``, a
    ``RuntimeError`` for any other form, as torch raises; elastictk's own checks (counts of at
    least 1, MIN <= MAX) say what was wrong in its message."""
    from .cli.values import parse_nnodes

    try:
        return parse_nnodes(nnodes)
    except ValueError as e:
        raise RuntimeError(str(e)) from None


def _entrypoint_name(config: LaunchConfig) -> str:
    """What torch names the failed entrypoint: the script (or module, or binary) launched."""
    return config.training_script or (config.entrypoint[0] if config.entrypoint else PROG)


def _exception_for(config: LaunchConfig, result: "AgentResult") -> Exception:
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    if result.exit_code > 128 and result.state == "signalled":
        return SignalException(result.message, signal.Signals(result.exit_code - 128))
    if result.state == "preempted" and config.preempt_signal is not None:
        return SignalException(result.message, config.preempt_signal)
    from .agent.failed import WorkersFailed

    return WorkersFailed(_entrypoint_name(config), result)


if TYPE_CHECKING:  # pragma: no cover
    from .agent import AgentResult
    from .agent.config import AgentConfig
    from .supervisor.forkserver import PreloadServer


def _run(config: LaunchConfig, server: "PreloadServer | None", *,
         join_watchers: bool) -> "AgentResult | None":
    """The agent's run, or None after printing why it could not start."""
    from .agent.launch import build_agent
    from .metrics import Telemetry, TelemetryError
    from .store import StoreError

    try:
        telemetry = Telemetry.from_launch(config)
    except TelemetryError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return None
    _await_store_host(config)
    try:
        try:
            agent, handle = build_agent(config, telemetry, preload_server=server)
        except StoreError as e:
            print(f"{PROG}: error: {_naming_the_flag(config, str(e))}", file=sys.stderr)
            return None
        agent.config.join_watchers = join_watchers
        _slurm_drain(config, agent.config)
        from .agent.torch_events import record_agent_end

        bridge = getattr(agent, "torch_events")
        try:
            result = agent.run()
        except BaseException:
            record_agent_end(bridge, False)
            raise
        finally:
            handle.close()
        # torchrun's launcher: SUCCEEDED when the agent's run returned, whatever its workers
        # did (their failure is in the per-worker events); FAILED when it ended by a signal or
        # an error of its own (rendezvous, store).
        record_agent_end(bridge, result.state in ("succeeded", "finished-elsewhere")
                         or (result.state == "failed" and result.report is not None))
        return result
    finally:
        telemetry.close()


def _naming_the_flag(config: LaunchConfig, message: str) -> str:
    """A store's error names ``--rdzv-endpoint``; a static job's endpoint may have come from
    ``--master-addr``/``--master-port``, and the line names what the user typed."""
    from .cli.preflight import endpoint_flag

    flag = endpoint_flag(config)
    return message if flag == "--rdzv-endpoint" else message.replace("--rdzv-endpoint", flag)


def __getattr__(name: str) -> object:
    if name == "WorkersFailed":  # torch is imported only when a library caller needs it
        from .agent.failed import WorkersFailed

        return WorkersFailed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def console_main() -> None:
    code = main(exits=True)  # SIGINT: _interrupted_while_starting until the agent's own handler
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

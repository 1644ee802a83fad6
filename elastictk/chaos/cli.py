"""``elastictk-chaos``: run a training job under a seeded, replayable fault plan and prove, with
a report, that restart semantics held.

::

    elastictk-chaos --seed 7 --faults 2 --at-steps 3:15 --standalone --nproc-per-node 2 \\
        --max-restarts 3 -- examples/train.py --steps 20 --ckpt-dir /tmp/ck

Several nodes: ``--nodes 3`` starts three agents on loopback over the rendezvous backend given
with ``--rdzv-backend`` (c10d, the default, hosted by node 0's agent; or etcd, a server of the
run's own), which makes ``kill-agent on node:N`` and ``store-outage:<s> on store`` possible::

    elastictk-chaos --nodes 3 --nnodes 2:3 --rdzv-backend etcd --at-seconds 4:8 \\
        --kinds kill-agent --faults 1 --nproc-per-node 1 -- examples/train.py --ckpt-dir {run_dir}

Flags before ``--`` that are not elastictk-chaos's own go to ``elastictk-run`` unchanged; after
``--`` comes the training command, where ``{run_dir}`` stands for a directory of each run's own
(so a fault-free comparison run never resumes from the chaos run's checkpoints). Exit codes: 0
when every invariant held, 1 when one broke (each broken one is named), 2 for bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence

from .._paths import Unsafe, check_own_file, write_file
from ..agent.pace import FLOOR
from ..faults import FaultPlan, PlanError, generate_plan
from ..faults.kinds import HANGS
from ..faults.plan import read_json
from . import report
from .cluster import BACKENDS
from .expect import Shape, short_of_nodes
from .flags import MAX_REPORT_BYTES, FlagError, check_flags, check_never, in_flag_terms, report_dir, window
from .multinode import run_nodes
from .replay import load_replay, replay_multinode
from .rows import fault_rows, restarts_of
from .runner import (
    OUTSIDE_SIGNALS, RunRecord, Stopped, keep_output, make_run_dir, owning_signals, run_job, stopped_by,
)
from .timeline import run_name, write_timeline

PROG = "elastictk-chaos"
NODE_KINDS = ("kill-agent", "store-outage")
#: ``--nodes`` at most: each node is an agent process (with its workers) on this machine.
MAX_NODES = 64
OWN_FLAGS = ("--standalone", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--event-log",
             "--log-dir", "--log_dir")


class _Parser(argparse.ArgumentParser):
    """argparse's refusals as one line (:class:`Usage`, exit 2), not a usage dump."""

    def error(self, message: str) -> NoReturn:
        if message.endswith("expected one argument"):
            message += "; give a value starting with '-' as --flag=VALUE"
        raise Usage(f"{message} (see {PROG} --help)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("::")[0].strip(), add_help=True)
    p.add_argument("--seed", type=int, default=0, help="seed of the generated plan (default 0)")
    p.add_argument("--faults", type=int, default=2, help="how many faults to generate (default 2)")
    p.add_argument("--kinds", default=None, help="comma-separated kinds to draw from, e.g. sigkill,exception,exit:3")
    p.add_argument("--at-steps", default="2:10", help="LO:HI steps the generated faults fall in (default 2:10)")
    p.add_argument("--at-seconds", default=None, help="LO:HI seconds after the start the generated faults "
                   "fall in, instead of steps (kill-agent and store-outage need it)")
    p.add_argument("--nodes", type=int, default=1, help="start this many agents on loopback, one job of "
                   "several nodes (default 1); --nnodes MIN:MAX still goes to each agent")
    p.add_argument("--rejoin", type=float, default=None, metavar="S", help="with --nodes: start a killed "
                   "node's agent again S seconds after the kill, so the job scales back up")
    p.add_argument("--kill-store-host", action="store_true", help="with --nodes and c10d: let generated "
                   "kill-agent faults hit node 0, which hosts the store (the job then fails)")
    p.add_argument("--never", default="", help="comma-separated ranks never to touch")
    p.add_argument("--plan", default=None, help="a fault plan JSON file instead of generating one")
    p.add_argument("--replay", default=None, help="rerun exactly the plan and command of a chaos-report.json")
    p.add_argument("--report-dir", default="chaos-report", help="where the report, picture and logs go")
    p.add_argument("--ckpt-every", type=int, default=None, help="the job's checkpoint interval in steps: "
                   "check that no fault loses more progress than that")
    p.add_argument("--compare-fault-free", action="store_true",
                   help="run the job once without faults first and check the final checksums agree")
    p.add_argument("--expect-checksum", default=None, help="the final checksum a fault-free run prints")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the job is stopped (default 600)")
    p.add_argument("--allow-unfired", action="store_true", help="a planned fault that did not fire is a "
                   "warning, not a failed run (each is still named, with why)")
    p.add_argument("--no-auto-steps", action="store_true", help="do not count optimizer steps as steps in "
                   "workers whose script never calls elastictk.faults.fault_point(step)")
    return p


class Usage(Exception):
    pass


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(chaos options, elastictk-run flags, training command)."""
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        head, command = argv[:cut], argv[cut + 1:]
    else:
        head, command = argv, []
    ns, launcher = _parser().parse_known_args(head)
    if not command and ns.replay is None:
        raise Usage("no training command: put it after '--', e.g. "
                    "elastictk-chaos --standalone --nproc-per-node 2 -- train.py")
    return ns, launcher, command


def build_plan(ns: argparse.Namespace, world: int, watchdog: Optional[float], nodes: int = 1,
               backend: str = "c10d") -> FaultPlan:
    if ns.plan is not None:
        return FaultPlan.load(ns.plan)
    when: dict = {"seconds": window("--at-seconds", ns.at_seconds, float)} if ns.at_seconds is not None \
        else {"steps": window("--at-steps", ns.at_steps, int)}
    kinds = [k.strip() for k in ns.kinds.split(",") if k.strip()] if ns.kinds is not None else None
    never = check_never(ns.never, world)
    # Losing node 0 under c10d loses the store and ends the job: spare it unless asked.
    spare = (0,) if nodes > 1 and backend == "c10d" and not ns.kill_store_host else ()
    try:
        return generate_plan(ns.seed, ns.faults, world, kinds=kinds, never=never, watchdog_s=watchdog,
                             nodes=nodes, spare_nodes=spare,
                             rejoin_s=ns.rejoin if nodes > 1 and "seconds" in when else None, **when)
    except PlanError as e:
        raise Usage(in_flag_terms(str(e), ns)) from None


def hang_watchdog(config: Any) -> Optional[float]:
    """The seconds after which the job catches a hang (the plan's ``watchdog_s``): the collective
    timeout if set, else under ``--hang-detection learned`` (the default) the learned deadlines'
    floor, the earliest a frozen rank is named (a ``slow:<s>`` step stays below it, so it is
    never taken for a hang); None when nothing would catch one."""
    if config.collective_timeout is not None:
        return config.collective_timeout
    if config.hang_detection == "learned":
        return min(FLOOR, config.progress_timeout or FLOOR)
    return None


def with_progress_watchdog(plan: FaultPlan, launcher: list[str],
                           collective_timeout: Optional[float]) -> list[str]:
    """A plan with hangs gets the progress watchdog at twice the collective timeout unless the
    launcher flags set one: a rank frozen inside DDP's all-reduce (issued from C++, so no
    collective timer is armed around it) is caught by its missing steps, within a bound of
    the same order as the timers'. Twice, so a ``slow:<s>`` step (kept below the collective
    timeout) is never taken for a hang."""
    hangs = any(f.kind in HANGS for f in plan.faults)
    given = any(a.split("=")[0] in ("--progress-timeout", "--progress_timeout") for a in launcher)
    if not hangs or given or collective_timeout is None:
        return launcher
    return [*launcher, "--progress-timeout", f"{2 * collective_timeout:g}"]


def check_supported(plan: FaultPlan, world: int, nodes: int = 1) -> None:
    for i, f in enumerate(plan.faults):
        if f.kind in NODE_KINDS and nodes < 2:
            raise Usage(f"fault #{i} ({f.describe()}): {f.kind} needs a job of several nodes; pass "
                        f"--nodes N (and --nnodes MIN:MAX) to run one, or use the other kinds")
        if f.at_s is not None and f.kind not in OUTSIDE_SIGNALS and f.kind not in NODE_KINDS:
            raise Usage(f"fault #{i} ({f.describe()}): {f.spec} at a time is not injected from "
                        "outside; give it at_step instead")
        if f.target.kind == "rank" and (f.target.index or 0) >= world:
            raise Usage(f"fault #{i} ({f.describe()}): the job has ranks 0..{world - 1}; "
                        "retarget it or raise --nproc-per-node")
        if f.target.kind == "node" and (f.target.index or 0) >= nodes:
            raise Usage(f"fault #{i} ({f.describe()}): the job has nodes 0..{nodes - 1}; "
                        "retarget it or raise --nodes")


def _one_node(nnodes: str | None) -> None:
    """A one-node chaos run given ``--nnodes MIN:MAX`` for several nodes: what to pass instead.
    A value that does not parse is left to elastictk-run's own line."""
    from ..cli.values import parse_nnodes

    try:
        lo, hi = parse_nnodes(nnodes or "1", "--nnodes")
    except ValueError:
        return
    if hi != 1:
        raise Usage(f"--nnodes {lo}:{hi}: {PROG} runs one node unless told otherwise; pass "
                    "--nodes N for a job of several nodes, or --nnodes 1")


def check_nodes(ns: argparse.Namespace, launcher: list[str]) -> None:
    """The multi-node flags that make sense together, one line for those that do not."""
    if ns.nodes < 1:
        raise Usage(f"--nodes {ns.nodes}: give at least 1")
    if ns.nodes > MAX_NODES:
        raise Usage(f"--nodes {ns.nodes}: at most {MAX_NODES}: each node is an agent process on this "
                    "machine; run a larger job across hosts with elastictk-run")
    if ns.nodes == 1:
        if ns.rejoin is not None or ns.kill_store_host:
            raise Usage("--rejoin and --kill-store-host need several nodes: pass --nodes N")
        return
    if ns.rejoin is not None and not ns.rejoin >= 0:
        raise Usage(f"--rejoin {ns.rejoin}: give seconds >= 0")
    mine = [a.split("=")[0] for a in launcher if a.split("=")[0] in OWN_FLAGS]
    if mine:
        raise Usage(f"{mine[0]}: with --nodes, {PROG} starts the store and the agents itself "
                    "(endpoint, job id, event logs); leave it out")


#: Not on a terminal (a CI log), the progress line is printed when a fault fires or a restart
#: happens, and otherwise once per this many seconds while the step moves.
PROGRESS_EVERY_S = 10.0


class Progress:
    """One updating line on a terminal. Elsewhere (a CI log, a pipe) a plain line per fault
    fired or restart, one every :data:`PROGRESS_EVERY_S` seconds while steps advance, and the
    last state at the end: a log of a long run stays readable, never a line per step."""

    def __init__(self, plan: FaultPlan, max_restarts: int, stream=sys.stderr,  # type: ignore[no-untyped-def]
                 every: float = PROGRESS_EVERY_S, clock=time.monotonic) -> None:
        self.plan, self.max_restarts, self.stream = plan, max_restarts, stream
        self.tty = stream.isatty()
        self.every, self.clock = every, clock
        self.last = ""
        self.last_events: tuple[int, int] | None = None
        self.printed_at: float | None = None
        self.pending = ""  # the newest line not printed yet (off a terminal)

    def __call__(self, rec: RunRecord) -> None:
        now = self.clock()
        restarts = restarts_of(rec)
        step = max((s for _, s in rec.steps), default=0)
        fired = len({i.fault for i in rec.injections})
        line = (f"{PROG}: {now - rec.started:5.1f}s  step {step}  faults {fired}/"
                f"{len(self.plan)}  restarts {restarts}/{self.max_restarts}")
        key = line.split("s  ", 1)[1]
        if self.tty:
            self.stream.write("\r" + line.ljust(72))
            self.stream.flush()
        elif key != self.last:
            events = (fired, restarts)
            due = self.printed_at is None or now - self.printed_at >= self.every
            if events != self.last_events or due:
                print(line, file=self.stream, flush=True)
                self.printed_at, self.last_events, self.pending = now, events, ""
            else:
                self.pending = line
        self.last = key

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")
        elif self.pending:  # the last state, if it was held back
            print(self.pending, file=self.stream, flush=True)
            self.pending = ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse, run, report; SIGTERM/SIGINT/SIGHUP stop the job (every process of it) and exit
    128+N."""
    with owning_signals():
        try:
            code = _main(argv)
        except Stopped:
            code = 1
        sig = stopped_by()
    if sig is not None:
        print(f"{PROG}: stopped by {signal.Signals(sig).name}: the job's processes were stopped",
              file=sys.stderr)
        return 128 + int(sig)
    return code


def _main(argv: Optional[Sequence[str]]) -> int:
    from ..cli import args as run_args
    from ..cli.values import UsageError

    try:
        ns, launcher, command = parse(sys.argv[1:] if argv is None else argv)
        check_flags(ns)
        if ns.replay:  # another user's, nested, huge or not UTF-8: one line before it is read
            replay_owned(ns.replay)
            read_json(ns.replay, "the chaos report", max_bytes=MAX_REPORT_BYTES, allow_nan=True)
        replay = load_replay(ns.replay) if ns.replay else None
        if replay is not None:
            plan, rlaunch, rcommand = replay
            launcher, command = launcher or rlaunch, command or rcommand
            multi = replay_multinode(ns.replay, MAX_NODES)
            if multi is not None and ns.nodes == 1:
                ns.nodes, ns.rejoin = multi["nodes"], multi["rejoin_s"]
        check_nodes(ns, launcher)
        if ns.nodes > 1 and not any(a.split("=")[0] == "--nnodes" for a in launcher):
            launcher = ["--nnodes", str(ns.nodes), *launcher]
        if ns.nodes > 1 and not any(a.split("=")[0] in ("--rdzv-backend", "--rdzv_backend") for a in launcher):
            launcher = ["--rdzv-backend", "c10d", *launcher]
        if ns.nodes == 1:  # said before elastictk-run's static backend refuses a MIN:MAX
            _one_node(run_args.build_parser().parse_args([*launcher, *command]).nnodes)
        try:
            extra = ["--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-id", "chaos"] if ns.nodes > 1 else []
            config = run_args.parse_args([*launcher, *extra, *command])
        except UsageError as e:
            raise Usage(f"{e} (a flag for elastictk-run)") from None
        if ns.nodes == 1 and config.max_nodes != 1:
            raise Usage(f"--nnodes {config.min_nodes}:{config.max_nodes}: {PROG} runs one node unless "
                        "told otherwise; pass --nodes N for a job of several nodes, or --nnodes 1")
        if ns.nodes > 1 and not config.min_nodes <= ns.nodes <= config.max_nodes:
            raise Usage(f"--nodes {ns.nodes} with --nnodes {config.min_nodes}:{config.max_nodes}: start "
                        "between MIN and MAX nodes")
        if ns.nodes > 1 and config.rdzv_backend not in BACKENDS:
            raise Usage(f"--rdzv-backend {config.rdzv_backend}: with --nodes use one of {', '.join(BACKENDS)}")
        world = int(config.nproc_per_node) * ns.nodes
        if replay is None:
            plan = build_plan(ns, world, hang_watchdog(config), ns.nodes, config.rdzv_backend)
        check_supported(plan, world, ns.nodes)
        launcher = with_progress_watchdog(plan, launcher, config.collective_timeout)
        out = report_dir(ns.report_dir)  # last: bad input above leaves no directory behind
    except (Usage, PlanError, FlagError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"{PROG}: plan (seed {plan.seed}): " + "; ".join(f"#{i} {f.describe()}" for i, f in enumerate(plan.faults)),
          file=sys.stderr)
    expect = ns.expect_checksum
    if ns.compare_fault_free:
        if ns.nodes > 1:  # run_job makes its own; the nodes' runner substitutes only
            make_run_dir(out, "fault-free")
        clean = run_job(None, launcher, command, out, timeout=ns.timeout, tag="fault-free") if ns.nodes == 1 \
            else run_nodes(None, launcher, command, out, nodes=ns.nodes, backend=config.rdzv_backend,
                           nproc=int(config.nproc_per_node), timeout=ns.timeout, tag="fault-free")
        if stopped_by() is not None:  # no faults ran yet: the fault-free output is the report
            logs = keep_output(clean, out / "fault-free-logs").parent
            print(f"{PROG}: interrupted during the fault-free run, before any fault; its output is "
                  f"in {logs}/", file=sys.stderr)
            return 1
        problem = fault_free_problem(clean, keep_output(clean, out / "fault-free-logs"))
        if problem is not None:
            print(f"{PROG}: error: {problem}", file=sys.stderr)
            return 1
        expect = clean.checksum
    prog = Progress(plan, config.max_restarts)
    shape = multi = None
    if ns.nodes > 1:
        hb = float(config.rdzv_conf.get("heartbeat_interval", 1.0))
        shape = Shape(ns.nodes, config.min_nodes, config.rdzv_backend, config.max_restarts,
                      float(config.rdzv_conf.get("heartbeat_timeout", max(10.0, hb * 3))), ns.rejoin is not None)
        multi = {"nodes": ns.nodes, "backend": config.rdzv_backend, "rejoin_s": ns.rejoin}
        short = short_of_nodes(shape, [f.target.index for f in plan.faults
                                       if f.kind == "kill-agent" and f.target.index is not None],
                               float(config.rdzv_conf.get("join_timeout", 600.0)))
        if short is not None:
            print(f"{PROG}: {short}", file=sys.stderr)
        make_run_dir(out, "chaos")
        rec = run_nodes(plan, launcher, command, out, nodes=ns.nodes, backend=config.rdzv_backend,
                        nproc=int(config.nproc_per_node), timeout=ns.timeout, rejoin_s=ns.rejoin, progress=prog,
                        auto_steps=not ns.no_auto_steps)
    else:
        rec = run_job(plan, launcher, command, out, timeout=ns.timeout, progress=prog,
                      auto_steps=not ns.no_auto_steps)
    prog.done()
    interrupted = stopped_by()
    if interrupted is not None:  # what fired so far, marked; main() exits 128+N
        print(f"{PROG}: interrupted by {signal.Signals(interrupted).name}: a partial report of what "
              f"ran for {rec.ended - rec.started:.1f}s follows; its checks say nothing of the whole job",
              file=sys.stderr)
    rows = fault_rows(plan, rec, shape)
    checks = report.check(plan, rec, rows, max_restarts=config.max_restarts, ckpt_every=ns.ckpt_every,
                          expect_checksum=expect, shape=shape, nproc=int(config.nproc_per_node),
                          allow_unfired=ns.allow_unfired, snapshot=tuple(config.snapshot),
                          snapshot_every=config.snapshot_every, snapshot_overlap=config.snapshot_overlap)
    tot = report.totals(rec, rows)
    print(report.render(rows, tot, checks))
    data = report.to_json(plan, rec, rows, checks, launcher, command, multi)
    if interrupted is not None:
        data["interrupted"] = signal.Signals(interrupted).name
    # Renamed into place (_paths.write_file): a symlink planted under a name is never followed.
    write_file(out / "chaos-report.json", json.dumps(data, indent=2) + "\n")
    write_file(out / "job-stdout.log", rec.stdout)
    write_file(out / "job-stderr.log", rec.stderr)
    picture = write_timeline(rec, out / "chaos-timeline.png", world, title=run_name(command, world), seed=plan.seed)
    print(f"{PROG}: report in {out}/chaos-report.json, {picture}", file=sys.stderr)
    broken = [c for c in checks if not c.ok]
    for r in rows:
        if not r.fired:
            print(f"{PROG}: {'warning' if ns.allow_unfired else 'error'}: fault #{r.index} ({r.kind} on "
                  f"{r.target} at {r.planned}) did not fire: {r.why}", file=sys.stderr)
    for c in broken:
        said = "not judged (it does not pass)" if c.unknown else "broken"
        print(f"{PROG}: invariant {said}: {c.name}: {c.detail}", file=sys.stderr)
    return 1 if broken else 0


def replay_owned(path: str) -> None:
    """``--replay REPORT`` runs the report's command and flags (a ``--health-check`` shell
    included): only a report this user wrote, that nobody else can write or swap, is run."""
    if not os.path.lexists(path):
        return  # read_json says so, in its own line
    try:
        check_own_file(path)
    except Unsafe as e:
        raise Usage(f"--replay {path}: {e}; replay only a report you wrote (another user's "
                    "report runs their command as you)") from None


def fault_free_problem(clean: RunRecord, stdout: Path) -> Optional[str]:
    """Why the fault-free run gives no checksum to compare with (one line, naming where its
    output was kept and what the script must print), or None."""
    logs = stdout.parent
    if clean.exit_code != 0:
        return (f"the fault-free run failed (exit {clean.exit_code}), so there is nothing to compare "
                f"with; its output is in {logs}/ (job-stderr.log)")
    if clean.checksum is None:
        return ("the fault-free run printed no 'final checksum <hex>' line: with --compare-fault-free "
                "the training script must print one at its end (e.g. print(f'final checksum {digest}') "
                f"on rank 0); its output is in {stdout}")
    return None


def console_main() -> None:
    sys.exit(main())

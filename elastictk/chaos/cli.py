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
from pathlib import Path
from typing import NoReturn, Optional, Sequence

from .._paths import Unsafe, check_own_file, write_file
from ..faults import PlanError
from ..faults.plan import read_json
from . import report
from .cluster import BACKENDS
from .expect import Shape, short_of_nodes
from .flags import MAX_REPORT_BYTES, PROG, FlagError, Usage, check_flags, report_dir
from .jobplan import MAX_NODES, _one_node, build_plan, check_nodes, check_supported, hang_watchdog, \
    with_progress_watchdog
from .multinode import run_nodes
from .progress import Progress
from .record import RunRecord
from .replay import load_replay, replay_multinode
from .rows import fault_rows
from .runner import Stopped, keep_output, make_run_dir, owning_signals, run_job, stopped_by
from .timeline import run_name, write_timeline


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

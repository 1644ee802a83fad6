"""``elastictk-chaos``: run a training job under a seeded, replayable fault plan and prove, with
a report, that restart semantics held.

::

    elastictk-chaos --seed 7 --faults 2 --at-steps 3:15 --standalone --nproc-per-node 2 \\
        --max-restarts 3 -- examples/train.py --steps 20 --ckpt-dir /tmp/ck

Flags before ``--`` that are not elastictk-chaos's own go to ``elastictk-run`` unchanged; after
``--`` comes the training command, where ``{run_dir}`` stands for a directory of each run's own
(so a fault-free comparison run never resumes from the chaos run's checkpoints). Exit codes: 0 when every invariant held, 1 when one broke
(each broken one is named), 2 for bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from ..faults import FaultPlan, PlanError, generate_plan
from . import report
from .runner import OUTSIDE_SIGNALS, RunRecord, run_job
from .timeline import draw

PROG = "elastictk-chaos"
UNSUPPORTED = {"kill-agent": "needs a job of several nodes", "store-outage": "needs a job of several nodes"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("::")[0].strip(), add_help=True)
    p.add_argument("--seed", type=int, default=0, help="seed of the generated plan (default 0)")
    p.add_argument("--faults", type=int, default=2, help="how many faults to generate (default 2)")
    p.add_argument("--kinds", default=None, help="comma-separated kinds to draw from, e.g. sigkill,exception,exit:3")
    p.add_argument("--at-steps", default="2:10", help="LO:HI steps the generated faults fall in (default 2:10)")
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


def build_plan(ns: argparse.Namespace, world: int, watchdog: Optional[float]) -> FaultPlan:
    if ns.plan is not None:
        return FaultPlan.load(ns.plan)
    lo, sep, hi = ns.at_steps.partition(":")
    try:
        window = (int(lo), int(hi))
    except ValueError:
        raise Usage(f"--at-steps {ns.at_steps!r}: write LO:HI, e.g. --at-steps 2:10") from None
    if not sep:
        raise Usage(f"--at-steps {ns.at_steps!r}: write LO:HI, e.g. --at-steps 2:10")
    kinds = [k.strip() for k in ns.kinds.split(",") if k.strip()] if ns.kinds else None
    try:
        never = tuple(int(r) for r in ns.never.split(",") if r.strip())
    except ValueError:
        raise Usage(f"--never {ns.never!r}: write rank numbers, e.g. --never 0,1") from None
    return generate_plan(ns.seed, ns.faults, world, kinds=kinds, steps=window, never=never,
                         watchdog_s=watchdog)


def check_supported(plan: FaultPlan, world: int) -> None:
    for i, f in enumerate(plan.faults):
        if f.kind in UNSUPPORTED:
            raise Usage(f"fault #{i} ({f.describe()}): {f.kind} {UNSUPPORTED[f.kind]}, and "
                        f"{PROG} runs one node; use the other kinds")
        if f.at_s is not None and f.kind not in OUTSIDE_SIGNALS:
            raise Usage(f"fault #{i} ({f.describe()}): {f.spec} at a time is not injected from "
                        "outside; give it at_step instead")
        if f.target.kind == "rank" and (f.target.index or 0) >= world:
            raise Usage(f"fault #{i} ({f.describe()}): the job has ranks 0..{world - 1}; "
                        "retarget it or raise --nproc-per-node")


class Progress:
    """One updating line on a terminal; a plain line per change otherwise."""

    def __init__(self, plan: FaultPlan, max_restarts: int, stream=sys.stderr) -> None:  # type: ignore[no-untyped-def]
        self.plan, self.max_restarts, self.stream = plan, max_restarts, stream
        self.tty = stream.isatty()
        self.last = ""

    def __call__(self, rec: RunRecord) -> None:
        restarts = sum(1 for e in rec.events if e.kind == "restart")
        step = max((s for _, s in rec.steps), default=0)
        fired = len({i.fault for i in rec.injections})
        line = (f"{PROG}: {time.monotonic() - rec.started:5.1f}s  step {step}  faults {fired}/"
                f"{len(self.plan)}  restarts {restarts}/{self.max_restarts}")
        key = line.split("s  ", 1)[1]
        if self.tty:
            self.stream.write("\r" + line.ljust(72))
            self.stream.flush()
        elif key != self.last:
            print(line, file=self.stream, flush=True)
        self.last = key

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..cli import args as run_args
    from ..cli.values import UsageError

    try:
        ns, launcher, command = parse(sys.argv[1:] if argv is None else argv)
        replay = report.load_replay(ns.replay) if ns.replay else None
        if replay is not None:
            plan, rlaunch, rcommand = replay
            launcher, command = launcher or rlaunch, command or rcommand
        try:
            config = run_args.parse_args([*launcher, *command])
        except UsageError as e:
            raise Usage(f"{e} (a flag for elastictk-run)") from None
        if config.max_nodes != 1:
            raise Usage(f"--nnodes {config.min_nodes}:{config.max_nodes}: {PROG} runs one node; "
                        "use --standalone or --nnodes 1")
        world = int(config.nproc_per_node)
        if replay is None:
            plan = build_plan(ns, world, config.collective_timeout)
        check_supported(plan, world)
    except (Usage, PlanError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    out = Path(ns.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{PROG}: plan (seed {plan.seed}): " + "; ".join(f"#{i} {f.describe()}" for i, f in enumerate(plan.faults)),
          file=sys.stderr)
    expect = ns.expect_checksum
    if ns.compare_fault_free:
        clean = run_job(None, launcher, command, out, timeout=ns.timeout, tag="fault-free")
        if clean.exit_code != 0 or clean.checksum is None:
            print(f"{PROG}: error: the fault-free run did not finish with a checksum (exit "
                  f"{clean.exit_code}); see {out}/fault-free-logs", file=sys.stderr)
            return 1
        expect = clean.checksum
    prog = Progress(plan, config.max_restarts)
    rec = run_job(plan, launcher, command, out, timeout=ns.timeout, progress=prog)
    prog.done()
    rows = report.fault_rows(plan, rec)
    checks = report.check(plan, rec, rows, max_restarts=config.max_restarts,
                          ckpt_every=ns.ckpt_every, expect_checksum=expect)
    tot = report.totals(rec, rows)
    print(report.render(rows, tot, checks))
    data = report.to_json(plan, rec, rows, checks, launcher, command)
    (out / "chaos-report.json").write_text(json.dumps(data, indent=2) + "\n")
    draw(rec, out / "chaos-timeline.png", world)
    (out / "job-stdout.log").write_text(rec.stdout)
    (out / "job-stderr.log").write_text(rec.stderr)
    print(f"{PROG}: report in {out}/chaos-report.json, timeline in {out}/chaos-timeline.png", file=sys.stderr)
    broken = [c for c in checks if not c.ok]
    for c in broken:
        print(f"{PROG}: invariant broken: {c.name}: {c.detail}", file=sys.stderr)
    return 1 if broken else 0


def console_main() -> None:
    sys.exit(main())

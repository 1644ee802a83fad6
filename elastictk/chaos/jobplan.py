"""The fault plan fitted to the job: generated from elastictk-chaos's flags (or loaded), the
watchdog a hang needs, and each fault and the multi-node flags checked against the job's ranks
and nodes before anything runs.

Apart from the command line (``cli.py``), which parses the flags and runs the job: here is what
a plan and a job must agree on, each disagreement one line (:class:`~.flags.Usage`, exit 2)
naming the fault or flag and what to change.
"""
from __future__ import annotations

import argparse
from typing import Any, Optional

from ..agent.pace import FLOOR
from ..faults import FaultPlan, PlanError, generate_plan
from ..faults.kinds import HANGS
from .flags import PROG, Usage, check_never, in_flag_terms, window
from .outside import OUTSIDE_SIGNALS

NODE_KINDS = ("kill-agent", "store-outage")
#: ``--nodes`` at most: each node is an agent process (with its workers) on this machine.
MAX_NODES = 64
OWN_FLAGS = ("--standalone", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--event-log",
             "--log-dir", "--log_dir")


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

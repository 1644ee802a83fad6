"""``python -m bench rendezvous --scale [--quick] [--json PATH]``: 8 to 1,024 simulated nodes.

Where ``python -m bench rendezvous`` runs one process per node (up to 256), this runs each node
as threads (``bench/_rdzv_scale_nodes.py``: elastictk's real handler, heartbeat, membership
watch, failure watch and straggler records) against a real server in a process of its own: the
c10d ``TCPStore`` and ``etcd``. For each size and store it measures, on a fresh server and job:

1. **formation**: from one start signal to the last node holding its rank in a round of
   ``--nnodes N`` (checked: ranks 0..N-1 once each, one round, one member list);
2. **steady state**: the store calls per second every node's agent makes while the job trains
   (counted at elastictk's ``Store`` interface, by operation), and the CPU the server process
   uses for them (psutil, the server's own process), over a window of a few straggler windows;
3. **a lost node**: one node stops heartbeating, as a host that lost power; the time until the
   first peer's watch names it lost, and until every survivor is in a new round without it
   (which closes as soon as the last live member is back: the protocol's time, not a wait for
   a replacement).

torch's own dynamic rendezvous (``--rdzv-backend c10d``) runs beside it on the same TCPStore
server (``--stores c10d``, ``bench/_rdzv_scale_c10d.py``): formation only, bounded by a cap per
size, with its per-join calls and bytes counted as elastictk's are.

Targets (issue 31): a 1,024-node round forms in < 2 s on TCPStore; the steady-state load on the
store (calls/s and the server's CPU) grows at most linearly with the nodes; the verdicts are
computed from the measured numbers (``bench/_rdzv_scale_fit.py``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence


from .common import RESULTS_DIR, loadavg, machine_info, now_text, raise_fd_limit, write_atomic
from . import _rdzv_scale_beside as beside
from . import _rdzv_scale_c10d as c10d
from ._rdzv_scale_report import BACKENDS, NOTES, STORES, markdown
from ._rdzv_scale_fit import Verdict, formed_within, linear_growth
from ._rdzv_scale_join import (
    forms_and_reforms, join_verdicts, load_refusal, per_join, refused, reform_within,
)

NAME = "rendezvous_scale"
TITLE = "Rendezvous at scale: 8 to 1,024 simulated nodes on TCPStore and etcd, torch's c10d beside"
FORM_LIMIT = 2.0  # seconds, for 1,024 nodes on TCPStore
REFORM_LIMIT = 3.0  # seconds from the loss noticed to every survivor in a new round, 1,024 nodes
KEPT_UP = 0.9  # of the heartbeats the protocol sends in a window
TOKEN = "bench-scale-secret"  # records signed, as a job with --rdzv-token runs


PHASES = ("form", "steady", "lost")


@dataclass(frozen=True)
class Plan:
    """Sizes per store, and the clocks of the simulated jobs."""

    sizes: dict[str, tuple[int, ...]]
    heartbeat_interval: float
    heartbeat_timeout: float
    warmup: float
    window: float
    form_cap: float  # seconds a round may take to form before the case is given up
    c10d_cap: float  # seconds torch's c10d rendezvous is given to form, per size
    reform_cap: float  # seconds after the heartbeat timeout the re-form is waited for
    phases: tuple[str, ...] = PHASES  # "form" alone, or all three


FULL = Plan({"tcp": (8, 64, 256, 1024), "etcd": (8, 64, 256, 1024), "c10d": (8, 64, 256, 1024)},
            heartbeat_interval=1.0, heartbeat_timeout=10.0, warmup=2.0, window=8.0,
            form_cap=150.0, c10d_cap=60.0, reform_cap=60.0)
# A smoke run: shorter clocks (a lost node is noticed after 2 s, not 10), two small sizes.
QUICK = Plan({"tcp": (8, 32), "etcd": (8,), "c10d": (8,)},
             heartbeat_interval=0.5, heartbeat_timeout=2.0, warmup=0.5, window=1.5,
             form_cap=30.0, c10d_cap=30.0, reform_cap=30.0)


def choose_plan(base: Plan, stores: str | None, sizes: str | None, phases: str) -> Plan:
    """``base`` narrowed to the stores, sizes and phases asked for; ValueError names a bad one."""
    names = [s.strip() for s in stores.split(",")] if stores is not None else list(base.sizes)
    bad = [s for s in names if s not in BACKENDS]
    if bad or not all(names):
        raise ValueError(f"--stores {stores!r}: give a comma-separated list of tcp, etcd and c10d")
    try:
        ns = tuple(int(x) for x in sizes.split(",")) if sizes is not None else None
    except ValueError:
        ns = ()
    if ns is not None and (not ns or any(n < 2 or n > 4096 for n in ns)):
        raise ValueError(f"--sizes {sizes!r}: give comma-separated node counts from 2 to 4096, e.g. 64,256,1024")
    # torch's c10d rounds take every core while they run: after elastictk's stores, not before
    names.sort(key=lambda s: s == "c10d")
    return dataclasses.replace(base, sizes={s: ns or base.sizes[s] for s in names},
                               phases=("form",) if phases == "form" else PHASES)


class ScaleError(RuntimeError):
    """A case went wrong (a node failed to join, rounds disagree): one line says how."""


def _log(start: float, msg: str) -> None:
    print(f"[{time.monotonic() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _check_round(reports: Sequence[Any], world: int, where: str) -> int:
    errors = [r for r in reports if r.error is not None or r.joined_at is None]
    if errors:
        raise ScaleError(f"{where}: {len(errors)} node(s) did not join, the first: {errors[0].error}")
    if len({r.round for r in reports}) != 1:
        raise ScaleError(f"{where}: nodes ended in different rounds")
    if sorted(r.rank for r in reports) != list(range(world)) or {r.world for r in reports} != {world}:
        raise ScaleError(f"{where}: ranks are not 0..{world - 1} once each")
    from ._rdzv_scale_fleet import _digest

    read = {r.members for r in reports if r.members is not None}  # a sample of nodes read it back
    if not read or read != {_digest([r.node_id for r in reports])}:
        raise ScaleError(f"{where}: nodes disagree on the member list")
    return int(reports[0].round)


def run_case(backend: str, n: int, plan: Plan, tmp: str, log: Any) -> dict[str, Any]:
    """One store, one size: formation, steady state, a lost node (see the module docstring)."""
    from elastictk.rendezvous import RendezvousConfig

    from ._rdzv_scale_fleet import Fleet
    from ._rdzv_scale_store import start

    server = start(backend, tmp)
    fleet: Fleet | None = None
    out: dict[str, Any] = {"backend": backend, "nodes": n}
    label = f"{BACKENDS[backend]} with {n} nodes"
    try:
        cfg = RendezvousConfig(f"scale-{backend}-{n}-{uuid.uuid4().hex[:8]}", min_nodes=n, max_nodes=n,
                               last_call=30.0, join_timeout=120.0, token=TOKEN,
                               heartbeat_interval=plan.heartbeat_interval,
                               heartbeat_timeout=plan.heartbeat_timeout)
        t = time.monotonic()
        fleet = Fleet(backend, server.endpoint, cfg, n)
        fleet.ask("build")
        out["setup_s"] = round(time.monotonic() - t, 3)
        out["client_processes"] = len(fleet.procs)
        # 1. formation
        calls0, me0 = fleet.tally()
        cpu0 = server.cpu_seconds()
        t0 = time.monotonic() + 0.2
        fleet.ask("join", t0)
        reports = fleet.reports(t0 + plan.form_cap)
        first_round = _check_round(reports, n, label)
        joined = [r.joined_at for r in reports if r.joined_at is not None]  # all: checked above
        out["form_s"] = round(max(joined) - t0, 4)
        out["form_first_rank_s"] = round(min(joined) - t0, 4)
        out["form_join"] = per_join([r.cost for r in reports])
        calls_f, me_f = fleet.tally()
        out["form_calls"] = sum((calls_f - calls0).values())
        out["form_nodes_cpu_s"] = round(me_f - me0, 3)
        out["form_server_cpu_s"] = round(server.cpu_seconds() - cpu0, 3)
        j = out["form_join"] or {}
        log(f"  {BACKENDS[backend]} {n:5d} nodes: formed in {out['form_s']:.3f}s (setup {out['setup_s']:.1f}s); "
            f"per join {j.get('calls', {}).get('median')} calls, {j.get('bytes', {}).get('median')} B (median)")
        if plan.phases == ("form",):
            return out
        # 2. steady state
        fleet.ask("run")
        time.sleep(plan.warmup)
        (calls1, me1), cpu1, t1 = fleet.tally(), server.cpu_seconds(), time.monotonic()
        time.sleep(plan.window)
        (calls2, me2), cpu2, t2 = fleet.tally(), server.cpu_seconds(), time.monotonic()
        dt = t2 - t1
        by_op: Counter[str] = calls2 - calls1
        out["steady_window_s"] = round(dt, 3)
        out["steady_calls_per_s"] = round(sum(by_op.values()) / dt, 1)
        out["steady_calls_per_node_s"] = {op: round(c / dt / n, 3) for op, c in sorted(by_op.items())}
        out["steady_server_cpu"] = round((cpu2 - cpu1) / dt, 4)
        out["steady_bench_cpu"] = round((me2 - me1) / dt, 3)
        out["server_rss_mib"] = round(server.rss_mib(), 1)
        log(f"  {BACKENDS[backend]} {n:5d} nodes: {out['steady_calls_per_s']:.0f} calls/s, server "
            f"{100 * out['steady_server_cpu']:.1f}% of a core, the nodes {out['steady_bench_cpu']:.2f} cores")
        # 3. a lost node: the one with rank n // 2
        victim = next(r.index for r in reports if r.rank == n // 2)
        t_kill = time.monotonic()
        cap = plan.heartbeat_timeout + plan.reform_cap
        try:
            fleet.ask("kill", victim)
            fleet.ask("reform", t_kill + plan.heartbeat_timeout + 120, n - 1, victim)
            survivors = fleet.reports(t_kill + cap, victim)
        except TimeoutError as e:  # the numbers above stand; this phase says how far it went
            out.update(lost_noticed_s=None, lost_all_told_s=None, reformed_s=None,
                       reform_note=f"the re-form was not measured: {e}")
            log(f"  {BACKENDS[backend]} {n:5d} nodes: {out['reform_note']}")
            return out
        noticed = [r.noticed_at for r in survivors if r.noticed_at is not None]
        out["lost_noticed_s"] = round(min(noticed) - t_kill, 3) if noticed else None
        out["lost_all_told_s"] = round(max(noticed) - t_kill, 3) if len(noticed) == n - 1 else None
        behind = [r for r in survivors if r.joined_at is None or r.round is None or r.round <= first_round]
        if behind:  # measured as far as it went: the case says how far, the next one runs
            out["reformed_s"] = None
            out["reform_note"] = (f"{len(behind)} of {n - 1} survivors were not in a new round "
                                  f"{cap:g} s after the loss (the first: {behind[0].error or 'still joining'})")
            log(f"  {BACKENDS[backend]} {n:5d} nodes: {out['reform_note']}")
            return out
        out["reform_join"] = per_join([r.cost for r in survivors])
        _check_round(survivors, n - 1, f"{label}: the re-formed round of {n - 1}")
        out["reformed_s"] = round(max(r.joined_at or 0.0 for r in survivors) - t_kill, 3)
        log(f"  {BACKENDS[backend]} {n:5d} nodes: lost node noticed after {out['lost_noticed_s']:.2f}s, "
            f"re-formed after {out['reformed_s']:.2f}s")
        return out
    except TimeoutError as e:
        raise ScaleError(f"{label}: {e}") from None
    finally:
        if fleet is not None:
            fleet.close()
        server.close()


def kept_up(case: dict[str, Any], heartbeat_interval: float) -> bool:
    """Whether the simulated nodes kept the protocol's pace in the steady-state window: each
    bumps its heartbeat once per interval (on etcd: renews its lease every third of the
    heartbeat timeout), so fewer beats mean the nodes (sharing this machine's cores) were the
    limit, and the window measures them, not the store."""
    return beat_share(case, heartbeat_interval) >= KEPT_UP


def beat_share(case: dict[str, Any], heartbeat_interval: float) -> float:
    """The share of the protocol's heartbeats the nodes sent in the steady-state window."""
    per = case.get("steady_calls_per_node_s")
    if per is None:
        return 1.0
    if case.get("backend") == "etcd":  # liveness by lease: a keepalive per renewal period
        timeout = case.get("heartbeat_timeout", 10.0 * heartbeat_interval)
        return float(per.get("keepalive", 0.0)) * heartbeat_interval * max(1, int(timeout / 3 / heartbeat_interval))
    return float(per.get("add", 0.0)) * heartbeat_interval


def verdicts(cases: list[dict[str, Any]], heartbeat_interval: float = 1.0,
             refusal: str | None = None) -> list[Verdict]:
    """The targets, judged from the measured cases; a steady-state window whose nodes did not
    keep up is left out of the growth fits (the fit says which sizes it used). With a
    ``refusal`` (the machine was busier than its cores) the time targets are UNKNOWN, saying
    why; the per-join calls and bytes are judged all the same (load cannot change them)."""
    out: list[Verdict] = []
    for backend, label in STORES.items():
        for phase in ("form", "reform"):
            out.append(join_verdicts(cases, label, backend, phase))
    out.append(refused(reform_within(cases, 1024, REFORM_LIMIT), refusal))
    out.append(forms_and_reforms(cases, "etcd", "etcd", 1024))
    tcp_1024 = next((c for c in cases if c["backend"] == "tcp" and c["nodes"] == 1024), None)
    # Closed in the store: the first node holds its rank, so the closer's result is written.
    # Every node: each has also read and checked the N-member result, on this machine's cores.
    for key, what in (("form_first_rank_s", "is closed in the store (its first node has its rank)"),
                      ("form_s", "has every node holding its rank")):
        out.append(refused(formed_within("TCPStore", 1024, tcp_1024.get(key) if tcp_1024 else None,
                                         FORM_LIMIT, what), refusal))
    for backend, label in STORES.items():
        mine = [c for c in cases if c["backend"] == backend and "steady_calls_per_s" in c
                and kept_up(c, heartbeat_interval)]
        ns = [c["nodes"] for c in mine]
        out.append(linear_growth(f"{label}: store calls/s in steady state", ns,
                                 [c["steady_calls_per_s"] for c in mine]))
        out.append(linear_growth(f"{label}: the server's CPU in steady state", ns,
                                 [c["steady_server_cpu"] for c in mine]))
    out.append(beside.beside_verdict(cases))
    return out


def _lagged(cases: list[dict[str, Any]], heartbeat_interval: float) -> list[str]:
    lag = [c for c in cases if "steady_calls_per_s" in c and not kept_up(c, heartbeat_interval)]
    if not lag:
        return []
    which = ", ".join(f"{BACKENDS[c['backend']]} with {c['nodes']:,} nodes "
                      f"({beat_share(c, heartbeat_interval):.2f})" for c in lag)
    return [f"left out of the growth fits, because its nodes sent fewer than {KEPT_UP:g} of the "
            f"heartbeats the protocol sends (the share in brackets): {which}; the nodes share this "
            "machine's cores, so there the clients, not the store, set the pace"]


def run(plan: Plan, quick: bool, log: Any, save: Any = None) -> dict[str, Any]:
    # A node holds four store connections (and etcd opens one per wait): sockets add up.
    fd_limit = raise_fd_limit(12 * max(max(s) for s in plan.sizes.values()) + 1024)
    machine = machine_info()
    machine["loadavg_at_start"] = loadavg()
    stack = threading.stack_size(512 * 1024)  # thousands of threads: small stacks
    cases: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="elastictk-bench-scale-") as tmp:
            for backend, sizes in plan.sizes.items():
                for n in sizes:
                    try:
                        if backend == "c10d":  # bounded: a round not formed is measured, not an error
                            cases.append(c10d.run_case(n, plan.c10d_cap, tmp, log))
                        else:
                            cases.append(run_case(backend, n, plan, tmp, log))
                    except ScaleError as e:
                        log(f"  {BACKENDS[backend]} {n} nodes: {e}")
                        cases.append({"backend": backend, "nodes": n, "error": str(e)})
                    if save is not None:  # what is measured so far survives an interrupted run
                        save(_result(plan, quick, machine, cases, fd_limit, partial=True))
    finally:
        threading.stack_size(stack)
    return _result(plan, quick, machine, cases, fd_limit, partial=False)


def _result(plan: Plan, quick: bool, machine: dict[str, Any], cases: list[dict[str, Any]],
            fd_limit: int, partial: bool) -> dict[str, Any]:
    machine = {**machine, "loadavg_at_end": loadavg()}
    why = load_refusal(machine.get("loadavg_at_start"))
    for c in cases:  # what the etcd nodes' lease renewals are judged against (kept_up)
        c.setdefault("heartbeat_timeout", plan.heartbeat_timeout)
    return {
        "name": NAME, "title": TITLE, "quick": quick, "partial": partial, "when": now_text(), "machine": machine,
        "refusal": why,
        "cases": cases, "verdicts": [v.to_json() for v in verdicts(cases, plan.heartbeat_interval, why)],
        "notes": NOTES + _lagged(cases, plan.heartbeat_interval),
        "params": {"sizes": plan.sizes, "heartbeat_interval": plan.heartbeat_interval,
                   "form_cap_s": plan.form_cap, "c10d_cap_s": plan.c10d_cap, "reform_cap_s": plan.reform_cap,
                   "heartbeat_timeout": plan.heartbeat_timeout, "warmup_s": plan.warmup,
                   "window_s": plan.window, "form_limit_s": FORM_LIMIT, "reform_limit_s": REFORM_LIMIT,
                   "phases": list(plan.phases), "open_files_limit": fd_limit,
                   "cores": os.cpu_count()},
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench rendezvous --scale",
                                description="Rendezvous with 8 to 1,024 simulated nodes (threads) "
                                "against a real TCPStore and etcd; writes bench/results/"
                                f"{NAME}.md and .json unless --quick.")
    p.add_argument("--quick", action="store_true", help="a smoke run under a minute: small sizes, "
                   "short clocks, no files in bench/results")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write this run's results here")
    p.add_argument("--stores", metavar="LIST", help="comma-separated: tcp, etcd (elastictk's rendezvous over "
                   "each), c10d (torch's own, over a TCPStore; formation only) (default: all three)")
    p.add_argument("--sizes", metavar="LIST", help="comma-separated node counts (default: 8,64,256,1024)")
    p.add_argument("--phases", choices=("form", "all"), default="all",
                   help="form: formation alone (per-join costs and times); all: also steady state and a lost node")
    p.add_argument("--curves", action="store_true", help="run nothing: redraw the before/after table in "
                   "docs/benchmarks.md and docs/rendezvous-scale.svg from the kept report (a full run does it too)")
    args = p.parse_args(argv)
    if args.curves:
        from . import _rdzv_scale_curves as curves

        try:
            curves.regenerate(lambda msg: print(msg, file=sys.stderr))
        except (ValueError, OSError) as e:
            print(f"python -m bench rendezvous --scale --curves: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        plan = choose_plan(QUICK if args.quick else FULL, args.stores, args.sizes, args.phases)
    except ValueError as e:
        print(f"python -m bench rendezvous --scale: {e}", file=sys.stderr)
        return 2
    start = time.monotonic()
    # A c10d client looks up 127.0.0.1's name (DNS, PTR) as it connects; where the resolver
    # drops a query (this sandbox's does, about one in sixty) the connect waits out glibc's 5 s
    # timeout. Setup is not timed, but a thousand nodes open thousands of connections: ask
    # once, for one second. Set before the first lookup of this process and for the server's.
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    # c10d logs each client wait that times out from C++ (thousands a second here); elastictk's
    # TCPStore quiets it when it is imported before torch, so import it first.
    import elastictk.store.tcp  # noqa: F401

    def log(msg: str) -> None:
        _log(start, msg)

    log(f"== rendezvous --scale: {TITLE}{' (quick)' if args.quick else ''}")
    def save(partial: dict[str, Any]) -> None:
        for path in ([] if args.quick else [RESULTS_DIR / f"{NAME}.json"]) + ([args.json] if args.json else []):
            write_atomic(path, json.dumps(partial, indent=2) + "\n")

    def terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # unwinds like Ctrl-C: servers and workers are stopped

    signal.signal(signal.SIGTERM, terminate)
    try:
        result = run(plan, args.quick, log, save)
    except KeyboardInterrupt:
        print("python -m bench rendezvous --scale: interrupted (everything it started has been stopped)",
              file=sys.stderr)
        return 130
    text = markdown(result, (__doc__ or "").split("\n", 2)[2].strip().replace("``", "`"))
    print(text, flush=True)
    if not args.quick:
        write_atomic(RESULTS_DIR / f"{NAME}.md", text)
        write_atomic(RESULTS_DIR / f"{NAME}.json", json.dumps(result, indent=2) + "\n")
        log(f"wrote {RESULTS_DIR / NAME}.md and .json")
        from . import _rdzv_scale_curves as curves

        try:  # the docs' before/after curves follow the kept report
            curves.regenerate(log)
        except (ValueError, OSError) as e:
            log(f"the docs' curves were not redrawn: {e}")
    if args.json is not None:
        write_atomic(args.json, json.dumps(result, indent=2) + "\n")
    failed = any("error" in c for c in result["cases"]) or any(v["passed"] is False for v in result["verdicts"])
    return 1 if failed else 0

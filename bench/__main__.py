"""``python -m bench [name ...] [--quick] [--json PATH]``: run benchmarks, print and save tables.

``python -m bench snapshot --sizes 10,100`` runs a subset of the snapshot sizes (MB); a subset
does not replace the kept report (``--json PATH`` keeps its results).

Without ``--quick`` each benchmark's report goes to ``bench/results/<name>.md`` and ``.json``
(committed, so the README can quote the last full run). ``--quick`` is a smoke run that writes
nothing there; ``--json PATH`` writes all results of this run to PATH in either mode.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

from . import available, load
from .common import (
    RESULTS_DIR, BenchError, RunConfig, loadavg, machine_info, markdown_report, markdown_table,
    now_text, result_json, write_atomic,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run elastictk benchmarks side by side with their torch counterparts.",
    )
    p.add_argument("names", nargs="*", metavar="name",
                   help=f"benchmarks to run (default: all of {', '.join(available())})")
    p.add_argument("--quick", action="store_true",
                   help="seconds-long smoke run: tiny sizes, few samples, "
                   "no files in bench/results")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write this run's results here")
    p.add_argument("--no-results", action="store_true", help=argparse.SUPPRESS)  # snapshot --sizes: a subset
    return p


def _terminate(signum: int, frame: Any) -> NoReturn:
    # SIGTERM unwinds like Ctrl-C, so every benchmark stops the servers and clients it started.
    raise SystemExit(128 + signum)


#: Benchmarks with a command line of their own, run only when named first (not by a bare run).
ON_THEIR_OWN = ("soak",)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["soak"]:  # python -m bench soak [--quick] [--runs N] [--seed S] ...
        from . import soak
        return soak.main(argv[1:])
    if argv[:1] == ["snapshot"] and any(a.startswith("--device") for a in argv[1:]):
        rest = [x for a in argv[1:] for x in a.split("=", 1)]
        i = rest.index("--device")
        if rest[i + 1:i + 2] == ["cpu"]:  # the default benchmark, asked for by name
            argv = ["snapshot", *rest[:i], *rest[i + 2:]]
        else:  # the CUDA path (or one line saying what --device takes)
            from . import _snapshot_cuda
            return _snapshot_cuda.main(rest)
    if argv[:1] == ["snapshot"] and any(a.startswith("--sizes") for a in argv[1:]):
        argv, keep = _snapshot_sizes(argv)
        if not keep:  # a subset: the kept report stays the whole run's
            argv = argv + (["--no-results"] if "--quick" not in argv else [])
    if argv[:1] == ["rendezvous"] and "--scale" in argv[1:]:  # 8 to 1,024 simulated nodes
        from . import _rdzv_scale
        return _rdzv_scale.main([a for a in argv[1:] if a != "--scale"])
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("python -m bench: interrupted (everything it started has been stopped)",
              file=sys.stderr)
        return 130


def _snapshot_sizes(argv: list[str]) -> tuple[list[str], bool]:
    """``snapshot --sizes 10,100``: the sizes (MB) to run, out of 10, 100 and 1000; the rest of
    the command line, and whether it is every size (then the kept report is written)."""
    from . import snapshot

    flat = [x for a in argv for x in (a.split("=", 1) if a.startswith("--sizes=") else [a])]
    i = flat.index("--sizes")
    value = flat[i + 1] if i + 1 < len(flat) else ""
    try:
        sizes = sorted({int(v) for v in value.split(",")})
    except ValueError:
        sizes = []
    if not sizes or any(v not in (10, 100, 1000) for v in sizes):
        print(f"python -m bench snapshot: --sizes {value!r}: give a comma list of 10, 100 and 1000 "
              "(MB), e.g. --sizes 10,100", file=sys.stderr)
        raise SystemExit(2)
    snapshot.SIZES[:] = sizes
    return flat[:i] + flat[i + 2:], sizes == [10, 100, 1000]


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    names = args.names or [n for n in available() if n not in ON_THEIR_OWN]
    alone = [n for n in names if n in ON_THEIR_OWN]
    if alone:
        print(f"python -m bench: {alone[0]} runs on its own: python -m bench {alone[0]} --help",
              file=sys.stderr)
        return 2
    try:
        modules = {name: load(name) for name in names}
    except ValueError as e:
        print(f"python -m bench: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    cfg = RunConfig.make(args.quick)
    machine = machine_info()
    all_json: dict[str, Any] = {}
    failed: list[str] = []
    for name, module in modules.items():
        cfg.log(f"== {name}: {module.TITLE}{' (quick)' if args.quick else ''}")
        machine = {**machine, "loadavg_at_start": loadavg()}
        try:
            result = module.run(cfg)
        except BenchError as e:
            print(f"python -m bench: {name} failed: {e}", file=sys.stderr)
            failed.append(name)
            continue
        when = now_text()
        machine = {**machine, "loadavg_at_end": loadavg()}
        print(f"\n## {result.title}\n\n{markdown_table(result)}\n", flush=True)
        for note in result.notes:
            print(f"note: {note}")
        data = result_json(result, machine, when)
        all_json[name] = data
        if not args.quick and not args.no_results:
            write_atomic(RESULTS_DIR / f"{name}.md", markdown_report(result, machine, when))
            write_atomic(RESULTS_DIR / f"{name}.json", json.dumps(data, indent=2) + "\n")
            cfg.log(f"wrote {RESULTS_DIR / name}.md and .json")
    if args.json is not None:
        combined = {"quick": args.quick, "benchmarks": all_json}
        write_atomic(args.json, json.dumps(combined, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m bench snapshot --device cuda [--quick]``: the local tier's CUDA path, measured.

One process, a state on ``cuda:0`` (a model's parameters and Adam's two moments, a third
each, 1 GB in all; 100 MB with ``--quick``), ``--snapshot local`` in an agent-side memfd as
``elastictk-run`` creates it. Side by side, interleaved, ms (lower is better):

- **step + commit**: an Adam step and ``state.commit()`` (copy in commit; and pipelined,
  ``--snapshot-overlap 1``: the copy on its own stream, the next step queued behind it), against
  the step alone, and against a pinned device-to-host copy of the same bytes (the bus's speed);
- **restore**: ``state.restore()`` into the existing CUDA tensors (host to device from the
  page-locked slot, chunked, checksum beside it) against ``torch.load`` + ``load_state_dict``
  (file in the page cache) and a pinned host-to-device copy.

Writes ``bench/results/snapshot-cuda.md`` and ``.json`` (not with ``--quick``). Without a GPU:
one line, exit 2.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from .common import (
    RESULTS_DIR, BenchResult, Comparison, Measured, RunConfig, interleaved, loadavg, machine_info,
    markdown_report, markdown_table, now_text, result_json, write_atomic,
)

PROG = "python -m bench snapshot --device cuda"
MB = 10**6


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def run(cfg: RunConfig) -> BenchResult:
    import torch

    from elastictk import State
    from elastictk.snapshot.local import Holder

    size = 100 * MB if cfg.quick else 1000 * MB
    rounds, steps = (3, 5) if cfg.quick else (5, 10)
    n = size // 12  # float32: parameters, exp_avg, exp_avg_sq
    with Holder(1, 2 * size + 64 * MB) as holder:
        os.environ.update({**holder.env(), "ELASTICTK_SNAPSHOT": "local"})
        p = torch.nn.Parameter(torch.randn(n, device="cuda"))
        opt = torch.optim.Adam([p], lr=1e-3)
        p.grad = torch.ones_like(p)
        opt.step()
        model = torch.nn.Module()
        model.p = p
        plain = State(model=model, optimizer=opt, step=0)
        piped = State(model=model, optimizer=opt, step=0, snapshot_overlap=True)
        host = torch.empty(3 * n, dtype=torch.float32, pin_memory=True)
        dev = [p.detach(), *[t for t in opt.state[p].values() if t.numel() > 1]]

        def sample(subject: str) -> float:
            _sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                opt.step()
                if subject == "pinned copy":
                    for k, t in enumerate(dev):
                        host[k * n:(k + 1) * n].copy_(t, non_blocking=True)
                    _sync()
                elif subject != "step alone":
                    st = plain if subject == "step + commit" else piped
                    st.step += 1
                    st.commit()
            _sync()
            took = (time.perf_counter() - t0) / steps * 1000
            plain.flush()
            piped.flush()
            return took

        got = interleaved(["step alone", "step + commit", "step + commit, pipelined", "pinned copy"], sample, rounds)
        rows = []
        case = {"state": f"{size // MB} MB on cuda:0", "measure": "Adam step + commit"}
        for ours in ("step + commit", "step + commit, pipelined"):
            for ref in ("step alone", "pinned copy"):
                rows.append(Comparison(case, Measured(ours, got[ours]), Measured(ref, got[ref])))
        ckpt = Path(tempfile.mkdtemp(prefix="etk-bench-cuda-")) / "ckpt.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, ckpt)
        plain.step = max(plain.step, piped.step) + 1
        plain.commit()
        plain.flush()

        def restore(subject: str) -> float:
            _sync()
            t0 = time.perf_counter()
            if subject == "state.restore()":
                assert State(model=model, optimizer=opt, step=0).restore() == plain.step
            elif subject == "torch.load":
                sd = torch.load(ckpt, weights_only=True, map_location="cuda")
                model.load_state_dict(sd["model"])
                opt.load_state_dict(sd["optimizer"])
            else:
                for k, t in enumerate(dev):
                    t.copy_(host[k * n:(k + 1) * n], non_blocking=True)
            _sync()
            return (time.perf_counter() - t0) * 1000

        got = interleaved(["state.restore()", "torch.load", "pinned copy"], restore, rounds)
        case = {"state": f"{size // MB} MB on cuda:0", "measure": "restore into the existing tensors"}
        for ref in ("torch.load", "pinned copy"):
            rows.append(Comparison(case, Measured("state.restore()", got["state.restore()"]), Measured(ref, got[ref])))
        ckpt.unlink()
        ckpt.parent.rmdir()
        for st in (plain, piped):
            snap = st.__dict__.get("_snap")
            if snap:
                snap.close()
    return BenchResult(
        name="snapshot-cuda", title="Snapshots on CUDA: commit and restore vs pinned copies and torch.load",
        description=(__doc__ or "").split("\n", 1)[1].strip(), unit="ms", higher_is_better=False,
        rows=rows, notes=["Targets on an H100 (issue 40): 1 GB commit blocks <= 25 ms; pipelined <= 3 % of a "
                          "100 ms step; 1 GB restore <= 60 ms (>= 15x torch.load)."],
        params={"size_mb": size // MB, "rounds": rounds, "steps": steps, "quick": cfg.quick,
                "device": torch.cuda.get_device_name(0)})


def main(argv: list[str]) -> int:
    """``argv``: what follows ``python -m bench snapshot``."""
    quick = "--quick" in argv
    rest = [a for a in argv if a != "--quick"]
    if rest[:1] != ["--device"] or len(rest) != 2 or rest[1] != "cuda":
        print(f"python -m bench snapshot: {' '.join(argv)}: use --device cuda (or --device cpu, the "
              "default benchmark)", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(f"{PROG}: CUDA is absent here (torch {torch.__version__}: torch.cuda.is_available() is "
              "False); run it on a machine with an NVIDIA GPU and a CUDA build of torch", file=sys.stderr)
        return 2
    cfg = RunConfig.make(quick)
    machine = {**machine_info(), "loadavg_at_start": loadavg()}
    result = run(cfg)
    when = now_text()
    machine = {**machine, "loadavg_at_end": loadavg()}
    print(f"\n## {result.title}\n\n{markdown_table(result)}\n", flush=True)
    if not quick:
        write_atomic(RESULTS_DIR / "snapshot-cuda.md", markdown_report(result, machine, when))
        write_atomic(RESULTS_DIR / "snapshot-cuda.json", json.dumps(result_json(result, machine, when), indent=2) + "\n")
    return 0

"""Snapshots of ``elastictk.State``: the cost of committing every step, and of restoring.

One process, a state of the given size (a model's parameters and SGD momentum, half each), a
training step of 100 ms (sleep: the GPU's or the CPU's work, during which a background thread
can run). Per step, side by side, interleaved:

- **none**: no checkpoint (the step alone);
- **local**: ``state.commit()`` every step into this process's snapshot memory (an agent-side
  memfd ``Holder``, as ``elastictk-run --snapshot local`` creates), checksum in the background;
- **local+disk/10**: the same, and every 10th step written to disk in the background;
- **torch.save**: ``torch.save({"model":..., "optimizer":...})`` of the same state every step,
  to a local directory, on the training thread (the usual checkpoint).

Restore, as after a restart-all (a freshly built model and an optimizer that holds no momentum
yet): ``state.restore()`` from the local tier (agree, verify the checksum, load into the model
and optimizer) against ``torch.load`` of the same state from the local disk plus
``load_state_dict``, with the file in the page cache (it was just written) and dropped from it
(``posix_fadvise(DONTNEED)``). Rows compare ms per step (or per restore); lower is better.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import BenchResult, Comparison, Measured, RunConfig, interleaved

TITLE = "Snapshots: commit every step (local, local+disk) vs torch.save, and restore vs torch.load"
STEP_S = 0.1
MB = 10**6


def _state(size: int, **kw: Any) -> tuple[Any, Any, Any]:
    import torch

    from elastictk import State

    n = size // 8  # float32: half parameters, half momentum
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(n))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.w.grad = torch.ones(n)
    opt.step()
    return State(model=model, optimizer=opt, step=0, **kw), model, opt


def _fresh(size: int) -> tuple[Any, Any]:
    import torch

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(size // 8))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _uncache(path: Path) -> None:
    """Drop a (synced) file's pages from the page cache, as after a reboot or memory pressure."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(cfg: RunConfig) -> BenchResult:
    import torch

    from elastictk import State
    from elastictk.snapshot.local import Holder
    from elastictk.snapshot.settings import ENV_DIR, ENV_EVERY, ENV_TIERS

    sizes = [10 * MB, 100 * MB] + ([] if cfg.quick else [1000 * MB])
    steps = 5 if cfg.quick else 20
    rounds = 3 if cfg.quick else 5
    base = Path(tempfile.mkdtemp(prefix="etk-bench-snapshot-"))
    rows: list[Comparison] = []
    saved = {k: os.environ.get(k) for k in (ENV_TIERS, ENV_DIR, ENV_EVERY, "ELASTICTK_SNAPSHOT_REGIONS",
                                             "ELASTICTK_SNAPSHOT_REGION_SIZE", "ELASTICTK_SNAPSHOT_MEMORY")}
    try:
        for size in sizes:
            holder = Holder(1, 2 * size + 64 * MB)
            os.environ.update(holder.env())
            os.environ.pop(ENV_DIR, None)
            cfg.log(f"{size // MB} MB: {steps} steps of {STEP_S * 1000:.0f} ms per sample, {rounds} rounds")
            local, model_l, _ = _state(size, snapshot="local")
            both, model_b, _ = _state(size, snapshot="local,disk", snapshot_dir=str(base / f"d{size}"),
                                      snapshot_every=10)
            plain, model_p, opt_p = _state(size)
            ckpt = base / f"ckpt-{size}.pt"

            def sample(subject: str) -> float:
                t0 = time.perf_counter()
                for _ in range(steps):
                    time.sleep(STEP_S)
                    if subject == "local":
                        local.step += 1
                        local.commit()
                    elif subject == "local+disk/10":
                        both.step += 1
                        both.commit()
                    elif subject == "torch.save":
                        torch.save({"model": model_p.state_dict(), "optimizer": opt_p.state_dict(),
                                    "step": 0}, ckpt)
                local.flush()
                both.flush()
                return (time.perf_counter() - t0) / steps * 1000

            got = interleaved(["none", "local", "local+disk/10", "torch.save"], sample, rounds)
            m = {k: Measured(k, v) for k, v in got.items()}
            case = {"state": f"{size // MB} MB", "measure": "step (100 ms of work) + commit"}
            for ours in ("local", "local+disk/10"):
                rows.append(Comparison(case, m[ours], m["torch.save"]))
                rows.append(Comparison(case, m[ours], m["none"]))

            torch.save({"model": model_p.state_dict(), "optimizer": opt_p.state_dict()}, ckpt)
            _sync(ckpt)
            both.flush()
            local.step = max(local.step, both.step) + 1  # the newest snapshot: local's, not both's
            local.commit()
            local.flush()

            cpu: dict[str, list[float]] = {}

            def restore(subject: str) -> float:
                # As after a restart: the script has built its model (parameters allocated and
                # initialized) and a fresh optimizer, which holds no momentum yet.
                fresh_m, fresh_o = _fresh(size)
                if subject == "local":
                    fresh = State(model=fresh_m, optimizer=fresh_o, step=0, snapshot="local")
                    c0, t0 = time.process_time(), time.perf_counter()
                    assert fresh.restore() is not None
                else:
                    if subject == "torch.load, file not in the page cache":
                        _uncache(ckpt)
                    c0, t0 = time.process_time(), time.perf_counter()
                    sd = torch.load(ckpt, weights_only=True)
                    fresh_m.load_state_dict(sd["model"])
                    fresh_o.load_state_dict(sd["optimizer"])
                took = (time.perf_counter() - t0) * 1000
                cpu.setdefault(subject, []).append((time.process_time() - c0) * 1000)
                assert torch.equal(fresh_m.w, model_p.w if subject != "local" else model_l.w)
                return took

            got = interleaved(["local", "torch.load", "torch.load, file not in the page cache"],
                              restore, rounds)
            ours = Measured("state.restore() from local memory", got["local"])
            case = {"state": f"{size // MB} MB", "measure": "restore after a restart"}
            rows.append(Comparison(case, ours, Measured("torch.load from local disk (page cache)",
                                                        got["torch.load"])))
            rows.append(Comparison(case, ours, Measured(
                "torch.load from local disk (dropped from the page cache)",
                got["torch.load, file not in the page cache"])))
            # The work itself, whatever else the machine runs: CPU time of this process.
            rows.append(Comparison({"state": f"{size // MB} MB", "measure": "restore, CPU time"},
                                   Measured("state.restore() from local memory", cpu["local"]),
                                   Measured("torch.load from local disk (page cache)",
                                            cpu["torch.load"])))
            local.flush()
            both.flush()
            local = both = None  # type: ignore[assignment]  # free before the next size
            holder.close()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(base, ignore_errors=True)
    notes = [f"A step is {STEP_S * 1000:.0f} ms of sleep; a commit's overhead is the step's time "
             "minus that of 'none'. The disk tier and the checksum run on a background thread "
             "during the next step; torch.save runs on the training thread.",
             "Restore from local memory includes the agreement (one rank here), mapping the part's "
             "pages, its checksum (XXH3-64), the copy into the model's parameters and the "
             "optimizer's fresh momentum; torch.load reads the file into fresh memory, then "
             "load_state_dict copies the parameters.",
             "'restore, CPU time' is the CPU time the restoring process spent (time.process_time: "
             "its own threads, page faults included), which a machine busy with other work "
             "inflates less than the wall time.",
             "Both restores must touch every byte of the state and place the optimizer's half in "
             "fresh pages (a restarted process has no other); on this machine a fresh 4 kB page "
             "costs about as much as copying it several times, which bounds the ratio."]
    return BenchResult(
        name="snapshot", title=TITLE, description=(__doc__ or "").split("\n", 1)[1].strip(),
        unit="ms", higher_is_better=False, rows=rows, notes=notes,
        params={"sizes_mb": [s // MB for s in sizes], "steps": steps, "rounds": rounds,
                "step_s": STEP_S, "quick": cfg.quick},
    )

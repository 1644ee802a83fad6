"""Snapshots of ``elastictk.State``: the cost of committing every step, and of restoring.

One process, a state of the given size (a model's parameters and SGD momentum, half each), a
training step of 100 ms (sleep: the GPU's or the CPU's forward and backward, during which a
background thread can run) and an SGD step over the state. Per step, side by side, interleaved:

- **none**: no checkpoint (the step alone);
- **local**: ``state.commit()`` every step into this process's snapshot memory (an agent-side
  memfd ``Holder``, as ``elastictk-run --snapshot local`` creates), checksum in the background;
- **local, pipelined**: the same with ``--snapshot-overlap 1``: the optimizer's tensors are
  copied during the next step's 100 ms, and the SGD step waits for the copy;
- **local+peer, pipelined**: ``--snapshot local,peer --snapshot-overlap 1``: the memory is node
  A's agent's (another process, as in a job), which sends every sealed slot to node B's agent
  over the peer tier;
- **local+peer+disk/10, pipelined**: the same, and every 10th step written to disk (DCP) in the
  background;
- **torch.save**: ``torch.save({"model":..., "optimizer":...})`` of the same state every step,
  to a local directory, on the training thread (the usual checkpoint);
- **DCP async_save**: ``torch.distributed.checkpoint.async_save`` of the same state every step
  (waiting for the previous save first, one in flight), 10 MB and 100 MB only.

Restore, as after a restart-all (a freshly built model and an optimizer that holds no momentum
yet): ``state.restore()`` from the local tier (agree, verify the checksum, load into the model
and optimizer) against ``torch.load`` of the same state from the local disk plus
``load_state_dict``, with the file in the page cache (it was just written) and dropped from it
(``posix_fadvise(DONTNEED)``), and DCP's load (``get_state_dict``, ``dcp.load``,
``set_state_dict``). Rows compare ms per step (or per restore); lower is better.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from .common import BenchResult, Comparison, Measured, RunConfig, interleaved

TITLE = "Snapshots: commit every step (local, pipelined, +peer, +disk) vs torch.save and DCP, and restore"
PIPED = "local, pipelined"  # --snapshot-overlap 1
PEER = "local+peer, pipelined"  # --snapshot local,peer --snapshot-overlap 1: A's agent replicates to B
ALL3 = "local+peer+disk/10, pipelined"  # and every 10th step to the disk tier (DCP)
DCP_SAVE = "DCP async_save"  # torch.distributed.checkpoint, every step
DCP_LOAD = "DCP load"
DCP_MAX = 100 * 10**6  # DCP every step at 1 GB: seconds per step, minutes per sample
BIG = 1000 * 10**6  # from here up, fewer samples (_samples)
SIZES: list[int] = []  # MB; ``--sizes`` (bench/__main__.py) sets a subset; empty: all
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


def _dcp_state(model: Any, opt: Any) -> dict[str, Any]:
    """DCP's own view of a model and optimizer (what its docs save and load)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd}


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


def _close(state: Any) -> None:
    """Unmap a restored state's snapshot memory (a finished worker's exit does the same)."""
    snap = state.__dict__.get("_snap")
    if snap:
        snap.close()


def _target(overhead: dict[int, dict[str, float]]) -> list[str]:
    """The issue's target: a commit costs at most 5 % of a 100 ms step at 100 MB."""
    if 100 * MB not in overhead:
        return []
    o = overhead[100 * MB]
    met = "met" if o[PEER] <= 0.05 else "missed"
    return [f"Target (commit overhead <= 5 % of a 100 ms step at 100 MB, local+peer): {met} by "
            f"'{PEER}' ({o[PEER] * 100:.1f} %); '{PIPED}' {o[PIPED] * 100:.1f} %; copying in commit() "
            f"('local') {o['local'] * 100:.1f} %. Pipelined: commit() copies only the skeleton and the module's buffers; the optimizer's "
            "tensors are copied during the next step's forward and backward, and its optimizer "
            "step waits for that copy."]


def run(cfg: RunConfig) -> BenchResult:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from elastictk import State
    from elastictk.snapshot.local import Holder
    from elastictk.snapshot.settings import ENV_DIR, ENV_EVERY, ENV_NOTIFY, ENV_TIERS

    from . import _snap_memory
    from ._peer_agents import Agents

    sizes = [s * MB for s in SIZES] if SIZES else [10 * MB, 100 * MB] + ([] if cfg.quick else [1000 * MB])
    base = Path(tempfile.mkdtemp(prefix="etk-bench-snapshot-"))
    rows: list[Comparison] = []
    overhead: dict[int, dict[str, float]] = {}
    memory: dict[int, dict[str, Any]] = {}
    tight: dict[int, dict[str, Any]] = {}  # the same, the replicas bounded to one part
    arrivals: dict[int, dict[str, dict[str, int]]] = {}  # per size, per run: replicas whole and torn
    samples: dict[int, tuple[int, int]] = {}  # per size: steps per sample, rounds
    running: list[Any] = []  # the agents' processes, closed however the run ends
    saved = {k: os.environ.get(k) for k in (ENV_TIERS, ENV_DIR, ENV_EVERY, "ELASTICTK_SNAPSHOT_REGIONS",
                                             "ELASTICTK_SNAPSHOT_REGION_SIZE", "ELASTICTK_SNAPSHOT_MEMORY",
                                             ENV_NOTIFY)}

    def memory_run(size: int, replica_memory: Optional[int] = None) -> dict[str, Any]:
        """A worker committing every step, its agent shipping to a second one (whose replicas
        ``replica_memory`` bounds): the peaks (:mod:`bench._snap_memory`)."""
        agents = Agents(2 * size + 64 * MB, replica_memory=replica_memory)
        running.append(agents)
        try:
            env = agents.ask("start")
            return _snap_memory.measure(size, agents, {**env, ENV_TIERS: "local"})
        finally:
            agents.close()

    try:
        for size in sizes:
            # First, alone (nothing else of this size allocated yet): peak memory per node.
            memory[size] = memory_run(size)
            cfg.log(_snap_memory.line(memory[size]))
            # The same with the replicas bounded to one part (--snapshot-replica-memory): 3x.
            tight[size] = memory_run(size, replica_memory=size * 3 // 2)
            cfg.log("--snapshot-replica-memory of one part: " + _snap_memory.line(tight[size]))
            arrivals[size] = {"memory": memory[size]["arrivals"], "memory, one part": tight[size]["arrivals"]}
            steps, rounds = _samples(size, cfg.quick)
            samples[size] = (steps, rounds)
            holder = Holder(1, 2 * size + 64 * MB)
            os.environ.update(holder.env())
            os.environ.pop(ENV_DIR, None)
            cfg.log(f"{size // MB} MB: {steps} steps of {STEP_S * 1000:.0f} ms per sample, {rounds} rounds")
            local, model_l, opt_l = _state(size, snapshot="local")
            piped, _, opt_o = _state(size, snapshot="local", snapshot_overlap=True)
            plain, model_p, opt_p = _state(size)
            ckpt = base / f"ckpt-{size}.pt"
            own_env = {k: os.environ[k] for k in holder.env()}
            # Two jobs' agents (node A owns the memory and replicates to node B), each in a process
            # of its own: one for local+peer, one for local+peer+disk/10 (the States read the env
            # at creation).
            agents, agents_b = Agents(2 * size + 64 * MB), Agents(2 * size + 64 * MB)
            running += [agents, agents_b]
            os.environ.update(agents.ask("start"))
            peer, model_r, opt_r = _state(size, snapshot="local", snapshot_overlap=True)
            os.environ.update(agents_b.ask("start"))
            both, model_b, opt_b = _state(size, snapshot="local,disk", snapshot_dir=str(base / f"d{size}"),
                                          snapshot_every=10, snapshot_overlap=True)
            os.environ.update(own_env)
            os.environ.pop(ENV_NOTIFY, None)
            states = {"local": (local, opt_l), ALL3: (both, opt_b), PIPED: (piped, opt_o),
                      PEER: (peer, opt_r)}

            pending: list[Any] = []  # DCP's save in flight (one at a time, as its docs advise)

            def sample(subject: str) -> float:
                t0 = time.perf_counter()
                for _ in range(steps):
                    time.sleep(STEP_S)  # forward and backward: only read the state
                    st, opt = states.get(subject, (None, opt_p))
                    opt.step()  # a pipelined commit's copy must be done by now
                    if st is not None:
                        st.step += 1
                        st.commit()
                    elif subject == "torch.save":
                        torch.save({"model": model_p.state_dict(), "optimizer": opt_p.state_dict(),
                                    "step": 0}, ckpt)
                    elif subject == DCP_SAVE:
                        while pending:
                            pending.pop().result()
                        pending.append(dcp.async_save(_dcp_state(model_p, opt_p),
                                                      checkpoint_id=str(base / f"dcp-{size}-async")))
                took = time.perf_counter() - t0
                # What the last step left running in the background (a checksum, a save) is
                # drained outside the sample: the training loop does not wait for it either.
                for st, _ in states.values():
                    st.flush()
                while pending:
                    pending.pop().result()
                if subject in (PEER, ALL3):  # and the agent's replication of the last commit
                    (agents if subject == PEER else agents_b).wait_replicated(states[subject][0].step)
                return took / steps * 1000

            subjects = ["none", "local", PIPED, PEER, ALL3, "torch.save"]
            if size <= DCP_MAX:
                subjects.append(DCP_SAVE)
            got = interleaved(subjects, sample, rounds)
            arrivals[size][PEER] = agents.ask("arrivals")
            arrivals[size][ALL3] = agents_b.ask("arrivals")
            cfg.log(f"{size // MB} MB: replicas that arrived whole / torn: "
                    + ", ".join(f"{k} {v['whole']}/{v['torn']}" for k, v in arrivals[size].items()))
            m = {k: Measured(k, v) for k, v in got.items()}
            case = {"state": f"{size // MB} MB", "measure": "step (100 ms of work + SGD) + commit"}
            for ours in ("local", PIPED, PEER, ALL3):
                rows.append(Comparison(case, m[ours], m["torch.save"]))
                if DCP_SAVE in m:
                    rows.append(Comparison(case, m[ours], m[DCP_SAVE]))
                rows.append(Comparison(case, m[ours], m["none"]))
            overhead[size] = {k: (statistics.median(got[k]) - statistics.median(got["none"])) / (STEP_S * 1000)
                              for k in ("local", PIPED, PEER)}

            torch.save({"model": model_p.state_dict(), "optimizer": opt_p.state_dict()}, ckpt)
            _sync(ckpt)
            dcp_dir = base / f"dcp-{size}"
            dcp.save(_dcp_state(model_p, opt_p), checkpoint_id=str(dcp_dir))
            both.step = (both.step // 10 + 1) * 10  # a disk step holding both's current weights
            both.commit()
            both.flush()
            piped.flush()
            local.step = max(local.step, both.step, piped.step) + 1  # the newest snapshot: local's
            peer.flush()
            agents.wait_replicated(peer.step)
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
                elif subject == PEER:  # node A lost: C's agent fetches from B, C's worker restores
                    agents.ask("drop")
                    got = agents.ask("fetch")
                    os.environ.update(got["env"])
                    fresh = State(model=fresh_m, optimizer=fresh_o, step=0, snapshot="local")
                    os.environ.update(own_env)
                    os.environ.pop(ENV_NOTIFY, None)
                    c0, t0 = time.process_time(), time.perf_counter() - got["fetch_ms"] / 1000
                    assert fresh.restore() == peer.step
                elif subject == "disk":
                    fresh = State(model=fresh_m, optimizer=fresh_o, step=0, snapshot="disk",
                                  snapshot_dir=str(base / f"d{size}"))
                    c0, t0 = time.process_time(), time.perf_counter()
                    assert fresh.restore() is not None
                elif subject == DCP_LOAD:
                    c0, t0 = time.process_time(), time.perf_counter()
                    sd = _dcp_state(fresh_m, fresh_o)  # DCP loads in place: the optimizer's state made first
                    dcp.load(sd, checkpoint_id=str(dcp_dir))
                    set_state_dict(fresh_m, fresh_o, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
                else:
                    if subject == "torch.load, file not in the page cache":
                        _uncache(ckpt)
                    c0, t0 = time.process_time(), time.perf_counter()
                    sd = torch.load(ckpt, weights_only=True)
                    fresh_m.load_state_dict(sd["model"])
                    fresh_o.load_state_dict(sd["optimizer"])
                took = (time.perf_counter() - t0) * 1000
                cpu.setdefault(subject, []).append((time.process_time() - c0) * 1000)
                assert torch.equal(fresh_m.w, {"local": model_l, PEER: model_r, "disk": model_b}.get(subject, model_p).w)
                if subject in ("local", PEER, "disk"):
                    _close(fresh)  # as the restarted worker's exit would: its mapping of the memory goes
                return took

            got = interleaved(["local", PEER, "disk", "torch.load", "torch.load, file not in the page cache",
                               DCP_LOAD], restore, rounds)
            ours = Measured("state.restore() from local memory", got["local"])
            case = {"state": f"{size // MB} MB", "measure": "restore after a restart"}
            rows.append(Comparison(case, ours, Measured("torch.load from local disk (page cache)",
                                                        got["torch.load"])))
            rows.append(Comparison(case, ours, Measured(
                "torch.load from local disk (dropped from the page cache)",
                got["torch.load, file not in the page cache"])))
            rows.append(Comparison(case, ours, Measured("DCP load from local disk (page cache)", got[DCP_LOAD])))
            from_peer = Measured("state.restore() from a peer (the agent's fetch included)", got[PEER])
            from_disk = Measured("state.restore() from the disk tier (DCP)", got["disk"])
            for theirs in (Measured("torch.load from local disk (page cache)", got["torch.load"]),
                           Measured("DCP load from local disk (page cache)", got[DCP_LOAD])):
                rows.append(Comparison(case, from_peer, theirs))
                rows.append(Comparison(case, from_disk, theirs))
            # The work itself, whatever else the machine runs: CPU time of this process.
            rows.append(Comparison({"state": f"{size // MB} MB", "measure": "restore, CPU time"},
                                   Measured("state.restore() from local memory", cpu["local"]),
                                   Measured("torch.load from local disk (page cache)",
                                            cpu["torch.load"])))
            local.flush()
            both.flush()
            piped.flush()
            peer.flush()
            agents.close()
            agents_b.close()
            local = both = piped = peer = None  # type: ignore[assignment]  # free before the next size
            states.clear()
            holder.close()
    finally:
        for a in running:
            a.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(base, ignore_errors=True)
    notes = [f"A step is {STEP_S * 1000:.0f} ms of sleep and an SGD step over the state; a commit's "
             "overhead is the step's time minus that of 'none', as a share of the 100 ms. The disk tier and the checksum run on a background thread "
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
             "costs about as much as copying it several times, which bounds the ratio.",
             *_target(overhead), _samples_note(samples), verdict(arrivals)[1],
             *[_snap_memory.line(m) for m in memory.values()]]
    cfg.log(verdict(arrivals)[1])
    description = ((__doc__ or "").split("\n", 1)[1].strip() + "\n\n" + _snap_memory.table(memory, tight)
                   + "\n\nMedians in ms of each size's interleaved samples follow.")
    return BenchResult(
        name="snapshot", title=TITLE, description=description,
        unit="ms", higher_is_better=False, rows=rows, notes=notes,
        params={"sizes_mb": [s // MB for s in sizes],
                "samples": {str(k // MB): {"steps": v[0], "rounds": v[1]} for k, v in samples.items()},
                "step_s": STEP_S, "quick": cfg.quick, "replicas_ok": verdict(arrivals)[0],
                "arrivals": {str(k // MB): v for k, v in arrivals.items()},
                "memory_per_node": {str(k // MB): v for k, v in memory.items()},
                "memory_per_node_one_replica_part": {str(k // MB): v for k, v in tight.items()}},
    )


def _samples(size: int, quick: bool) -> tuple[int, int]:
    """Steps per sample and rounds: fewer from :data:`BIG` up, where one round of every
    subject takes a minute (torch.save alone ~2 s a step), so the whole run fits ~12 minutes."""
    if quick:
        return 5, 3
    return (5, 3) if size >= BIG else (20, 5)


def _samples_note(samples: dict[int, tuple[int, int]]) -> str:
    return "Samples: " + "; ".join(f"{s // MB} MB: {st} steps per sample, {r} rounds"
                                   for s, (st, r) in samples.items()) + \
        " (fewer at 1 GB, where a round of every subject takes about a minute)."


def verdict(arrivals: dict[int, dict[str, dict[str, int]]]) -> tuple[bool, str]:
    """Whether every run that replicated while committing every step delivered whole
    replicas and none torn (pure): a run with no whole arrival, or any torn one, fails."""
    runs = [(size, name, a) for size, per in arrivals.items() for name, a in per.items()]
    bad = [f"{size // MB} MB {name}: {a['whole']} whole, {a['torn']} torn" for size, name, a in runs
           if a["torn"] or not a["whole"]]
    told = "; ".join(f"{size // MB} MB {name} {a['whole']} whole / {a['torn']} torn" for size, name, a in runs)
    if not runs:
        return False, "[FAIL] replicas under per-step commits: no run replicated anything"
    if bad:
        return False, f"[FAIL] replicas under per-step commits: {'; '.join(bad)} (all runs: {told})"
    return True, ("[ok] replicas under per-step commits: every run's replicas arrived whole, none "
                  f"torn ({told}; 'memory' is the 30-step memory run, the others the commit rows)")

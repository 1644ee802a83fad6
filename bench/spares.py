"""Spares: a node of a 2-node job is lost; recovery with a spare waiting vs without one.

One host, several launcher agents on loopback (``--rdzv-backend c10d``, the TCPStore hosted by
the first agent), ``--nnodes 1:2``, one worker per agent (``bench/_multinode_worker.py``: a gloo
all-reduce per step, each line stamped with ``time.monotonic()`` and its process). Two nodes
train; then either

- **a spare waits**: a third agent starts beyond ``--nnodes`` MAX and waits (elastictk: its
  ``waits as a spare`` line; torchrun logs nothing for it: ``TORCH_SETTLE`` seconds), and both
  ranks are seen stepping again, or
- **no spare**: nothing more starts, the job can only shrink to ``--nnodes`` MIN (1 node);

and a node that is training and does not host the store (its agent and worker) is SIGKILLed at
once, as a machine losing power. The sample is the time from the kill until every rank of the job formed
after it has logged a step from a new process: 2 ranks with the spare, 1 without (the world
size after is recorded with each sample).

Both launchers get the same budget to notice a silent node: elastictk ``heartbeat_interval=0.2,
heartbeat_timeout=2``, torchrun ``keep_alive_interval=1,keep_alive_max_attempt=2``; both
``last_call_timeout=1`` and ``--max-restarts 3``; torchrun with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see the recovery benchmark) and ``is_host`` set per
agent (on one host every agent would take the endpoint for its own). torchrun has no spare of its
own, but a node beyond MAX waits in its c10d rendezvous' redundancy list
(``dynamic_rendezvous.py``) and joins the next round, which is the reference here. A torchrun
launch that does not recover within the timeout is reported in the notes, not sampled.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import psutil

from ._agents import ELASTICTK_CONF, ROOT, TORCH_CONF, Agents, agent_argv
from .common import BenchError, BenchResult, Comparison, Measured, RunConfig, fmt, interleaved

TITLE = "Spares: a node of two lost, recovery with a waiting spare vs without, elastictk-run vs torchrun"
START_TIMEOUT, RECOVERY_TIMEOUT = 120.0, 60.0
SETTLE = 1.0  # after the spare waits, before the kill: the running job must not notice it
TORCH_SETTLE = 8.0  # torchrun's third agent: started, joined its rendezvous (it says nothing)
ARMS = ("elastictk spare", "elastictk none", "torchrun spare", "torchrun none")


class Job(Agents):
    """Agents of one job on loopback: start, watch the steps log, kill a node, reap by PID."""

    def __init__(self, launcher: str, work: Path) -> None:
        from elastictk.store import free_port

        super().__init__(launcher, work)
        work.mkdir()
        self.port = free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICTK_", "PET_"))}
        self.env.update(TMPDIR=str(work), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")

    def argv(self, i: int) -> list[str]:
        common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "spares",
                  "--max-restarts", "3"]
        return agent_argv(self.launcher, common, self.out, f"{TORCH_CONF},is_host={1 if i == 0 else 0}")

    def start(self) -> None:
        i = len(self.agents)
        with open(self.out / f"agent{i}.log", "w") as log:
            self.agents.append(subprocess.Popen(self.argv(i), cwd=ROOT, env=self.env, stdout=log,
                                                stderr=subprocess.STDOUT))
        if i == 0:  # the first agent hosts the store: the others join it
            self.wait("the store listening", self._listening, START_TIMEOUT)

    def _listening(self) -> Optional[float]:
        for c in psutil.Process(self.agents[0].pid).net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr.port == self.port:
                return time.monotonic()
        return None

    def tail(self) -> str:
        parts = []
        for i in range(len(self.agents)):
            lines = (self.out / f"agent{i}.log").read_text(errors="replace").strip().splitlines()
            parts.append(f"agent {i}: " + " / ".join(x[:200] for x in lines[-2:]))
        return "; ".join(parts)

    def member_not_hosting(self) -> int:
        """The agent, other than the store's host (agent 0), whose worker is stepping now: under
        torchrun a node arriving beyond MAX can take a member's place (see the notes)."""
        recent = {pid for t, _, _, pid in self.steps() if t > time.monotonic() - 1.0}
        for i, a in enumerate(self.agents[1:], 1):
            if any(c.pid in recent for c in psutil.Process(a.pid).children(recursive=True)):
                return i
        raise BenchError(f"{self.launcher}: no member but the store's host is stepping; {self.tail()}")


def lose_a_node(launcher: str, spare: bool, work: Path, pids: list[int]) -> tuple[float, int, bool]:
    """(seconds from the kill until the new job's every rank stepped, its world size, whether the
    spare's arrival restarted the running job: its ranks stepping from other processes)."""
    job = Job(launcher, work)
    try:
        job.start()
        job.start()
        job.wait("2 ranks stepping", lambda: job.stepping(2, 0.0, set()), START_TIMEOUT)
        before = {pid for _, _, _, pid in job.steps()}
        restarted = False
        if spare:
            job.start()
            if launcher == "elastictk":
                job.wait("the third agent waiting as a spare", lambda: job.logged(2, "waits as a spare"),
                         START_TIMEOUT)
            else:  # torchrun logs nothing for it: give it time, then the job must step again
                time.sleep(TORCH_SETTLE)
            time.sleep(SETTLE)
            t = time.monotonic()
            job.wait("2 ranks stepping with the spare waiting", lambda: job.stepping(2, t, set()),
                     START_TIMEOUT)
            restarted = bool({pid for u, _, _, pid in job.steps() if u > t} - before)
        old = {pid for _, _, _, pid in job.steps()}
        world = 2 if spare else 1
        t_kill = job.kill(job.member_not_hosting())
        done = job.wait(f"{world} rank(s) stepping after node 1 was lost",
                        lambda: job.stepping(world, t_kill, old), RECOVERY_TIMEOUT)
        return done - t_kill, world, restarted
    finally:
        (work / "stop").touch()
        pids += job.close()


def run(cfg: RunConfig) -> BenchResult:
    rounds = 1 if cfg.quick else 3  # a torchrun launch with a spare takes ~20 s
    arms = ARMS[:2] if cfg.quick else ARMS
    base = Path(tempfile.mkdtemp(prefix="etk-bench-spares-"))
    pids: list[int] = []
    worlds: dict[str, list[int]] = {a: [] for a in arms}
    failed: dict[str, list[str]] = {a: [] for a in arms}
    restarts: dict[str, list[bool]] = {a: [] for a in arms}
    counter = iter(range(10_000))

    def one(arm: str) -> float:
        launcher, kind = arm.split()
        try:
            took, world, restarted = lose_a_node(launcher, kind == "spare", base / f"{launcher}-{kind}-{next(counter)}",
                                      pids)
        except BenchError as e:
            if launcher == "elastictk":
                raise
            failed[arm].append(str(e)[:300])
            cfg.log(f"  {arm:15} did not recover: {str(e)[:150]}")
            return float("nan")
        worlds[arm].append(world)
        restarts[arm].append(restarted)
        cfg.log(f"  {arm:15} every rank of the {world}-rank job stepping {took:.2f}s after the kill")
        return took

    try:
        cfg.log(f"{rounds} round(s) of: 2 nodes train, node 1 lost ({', '.join(arms)})")
        got = interleaved(list(arms), one, rounds)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    got = {a: [x for x in xs if x == x] for a, xs in got.items()}  # drop the failed (nan)
    rows: list[Comparison] = []
    notes: list[str] = []
    labels = {"spare": "a spare waits: back to 2 nodes", "none": "no spare: shrinks to 1 node"}
    for kind in ("spare", "none"):
        ours = Measured(f"elastictk-run ({kind})", got[f"elastictk {kind}"],
                        {"world_after": worlds[f"elastictk {kind}"]})
        ref_arm = f"torchrun {kind}"
        if ref_arm in got and got[ref_arm]:
            ref = Measured(f"torchrun ({kind})", got[ref_arm], {"world_after": worlds[ref_arm]})
            rows.append(Comparison({"lost": "1 of 2 nodes", "case": labels[kind]}, ours, ref))
        elif cfg.quick:
            rows.append(Comparison({"lost": "1 of 2 nodes", "case": labels[kind]}, ours,
                                   Measured("elastictk-run (no spare)", got["elastictk none"]),
                                   "--quick runs elastictk only: spare against no spare"))
            break
        else:
            notes.append(f"torchrun ({kind}): no launch recovered; nothing to compare with")
    s, n = got["elastictk spare"], got["elastictk none"]
    notes.append(f"elastictk-run: with a spare every rank of the 2-node job steps "
                 f"{fmt(statistics.median(s))} s after the kill (median), without one the 1-node "
                 f"job steps after {fmt(statistics.median(n))} s: the spare brings the world back "
                 f"to MAX at no cost in recovery time ({fmt(statistics.median(s) - statistics.median(n))} s "
                 f"difference)")
    for arm in arms:
        if arm.endswith("spare") and restarts[arm]:
            notes.append(f"{arm}: the spare's arrival restarted the running job (its ranks stepped "
                         f"from new processes before the kill) in {sum(restarts[arm])} of "
                         f"{len(restarts[arm])} launches")
    for arm, errors in failed.items():
        if errors:
            notes.append(f"{arm}: {len(errors)} of {rounds} launches failed and are not sampled "
                         f"(the job did not train within {START_TIMEOUT:g}s, or did not recover within "
                         f"{RECOVERY_TIMEOUT:g}s of the kill); first: {errors[0]}")
    notes.append("workers are tiny gloo all-reduce loops (one per agent): the sample is the "
                 "launchers' own detection, rendezvous and restart; torchrun's workers are fresh "
                 "interpreters importing torch, elastictk-run's fork from a preloaded server")
    return BenchResult(
        name="spares", title=TITLE, description=(__doc__ or "").split("\n", 1)[1].strip(),
        unit="s", higher_is_better=False, rows=rows, notes=notes,
        params={"rounds": rounds, "nnodes": "1:2", "nproc_per_node": 1, "arms": list(arms),
                "elastictk_conf": ELASTICTK_CONF, "torchrun_conf": TORCH_CONF, "quick": cfg.quick},
        pids=sorted(set(pids)),
    )

"""Multinode: three test hosts train together; one host is lost; how long until the rest train.

Three hosts are network namespaces on a private bridge (``tests/helpers/netns.py``: root and iproute2;
traffic stays inside them). Each runs one launcher agent with two workers
(``bench/_multinode_worker.py``: gloo all-reduce per step), ``--nnodes 2:3``, c10d store on
host A. Once all six ranks are stepping, the whole of host C (its agent and every process under
it) is SIGKILLed at once, like a machine that loses power. The sample is the time from that
kill until every rank of the new 4-rank job has logged a step.

Both launchers get the same budget to notice a silent host: elastictk ``heartbeat_timeout=2``
(``heartbeat_interval=0.2``), torchrun ``keep_alive_interval=1,keep_alive_max_attempt=2``; both
``--max-restarts 3`` and ``last_call_timeout=1``. torchrun runs with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see the recovery benchmark).

Losing host A, the c10d store's host, is reported in the notes: what each launcher does, and
elastictk with ``--rdzv-backend etcd`` (a 3-member etcd cluster, one member per host), which
recovers from it. ``--quick`` runs elastictk only, once: a smoke test of the set-up.

Spares (full run only, a fourth host D): A, B and C train, D's agent starts beyond
``--nnodes`` MAX and waits as a spare, C is lost; the sample is the time until all six ranks
(A, B, D) step again, against the same loss without a spare (four ranks step again). torchrun
(which keeps such a node in its redundancy list) is run once with the spare, reported in the notes.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable


from ._agents import ELASTICTK_CONF, ROOT, TORCH_CONF, Agents, agent_argv
from .common import BenchError, BenchResult, Comparison, Measured, RunConfig, fmt, interleaved

if TYPE_CHECKING:  # pragma: no cover - the test hosts live with the tests (root, iproute2)
    from tests.helpers.netns import Hosts

TITLE = "Multinode: three hosts (network namespaces) recover from the loss of one, elastictk-run vs torchrun"
PORT = 29400
START_TIMEOUT = 120.0
RECOVERY_TIMEOUT = 90.0
PROBE_TIMEOUT = 45.0
SPARE_SETTLE = 10.0
SPARE_GAP = 1.0
def _argv(launcher: str, backend: str, endpoint: str, run_id: str, out: Path, store_host: bool) -> list[str]:
    common = ["--nnodes", "2:3", "--nproc-per-node", "2", "--rdzv-backend", backend,
              "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--max-restarts", "3"]
    # torchrun finds "the endpoint is me" by host name, which the test hosts share; say it.
    return agent_argv(launcher, common, out, TORCH_CONF + (",is_host=1" if store_host and backend == "c10d" else ""))


class Run(Agents):
    """One job across the hosts: start, wait for steps, kill a host, reap everything."""

    def __init__(self, hosts: "Hosts", launcher: str, base: Path, tag: str, backend: str = "c10d",
                 endpoint: str | None = None, count: int = 3) -> None:
        super().__init__(launcher, base / tag)
        self.hosts, self.tag = hosts, tag
        self.out.mkdir()
        self.endpoint = endpoint or f"{hosts[0].addr}:{PORT}"
        self.backend = backend
        # gloo would bind to what the host name resolves to (127.0.0.1 here, a loopback each
        # namespace has its own of): name the interface, as on a multi-NIC cluster.
        self.env = dict(os.environ, TMPDIR=str(self.out), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                        GLOO_SOCKET_IFNAME="eth0")
        for i in range(count):
            self.start(i)

    def start(self, i: int) -> None:
        """Start host ``i``'s agent (a host beyond --nnodes MAX waits as a spare)."""
        h = self.hosts[i]
        argv = _argv(self.launcher, self.backend, self.endpoint, self.tag, self.out, store_host=(i == 0))
        # Every test host has the machine's host name, which resolves to loopback: tell
        # each launcher the address its peers reach it at (torchrun needs it; both get it).
        argv[3:3] = ["--local-addr", h.addr]
        log = open(self.out / f"agent{i}.log", "w")
        self.agents.append(h.popen(argv, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        log.close()
        if i == 0 and self.backend == "c10d":
            try:
                self.hosts[1].wait_listening(self.hosts[0].addr, PORT)
            except TimeoutError as e:
                raise BenchError(str(e)) from None

    def tail(self) -> str:
        logs = []
        for i in range(len(self.agents)):
            text = (self.out / f"agent{i}.log").read_text(errors="replace")
            logs.append(f"host {i}: " + " / ".join(text.strip().splitlines()[-3:]))
        return "; ".join(logs)


def _lose_a_host(hosts: "Hosts", launcher: str, base: Path, tag: str, pids: list[int]) -> float:
    run = Run(hosts, launcher, base, tag)
    try:
        run.wait("six ranks stepping", lambda: run.stepping(6, 0.0), START_TIMEOUT)
        t_kill = run.kill(2)
        done = run.wait("four ranks stepping after host C was lost",
                        lambda: run.stepping(4, t_kill), RECOVERY_TIMEOUT)
        return done - t_kill
    finally:
        pids += run.close()


def _lose_a_host_with_a_spare(hosts: "Hosts", launcher: str, base: Path, tag: str, pids: list[int]) -> float:
    """Hosts A, B, C train; host D's agent starts and waits as a spare; host C is lost; the
    time until all six ranks (A, B and D) step again. Steps logged within SPARE_GAP of the
    kill are not counted: no launcher notices a silent host that fast (2 s budget), so a
    later six-rank step is the new job's."""
    run = Run(hosts, launcher, base, tag)
    try:
        run.wait("six ranks stepping", lambda: run.stepping(6, 0.0), START_TIMEOUT)
        run.start(3)
        if launcher == "elastictk":  # its agent says when it waits as a spare
            run.wait("host D waiting as a spare", lambda: run.logged(3, "spare_waiting"), START_TIMEOUT)
        else:  # torchrun says nothing at its default log level: give its agent time to start
            time.sleep(SPARE_SETTLE)
        time.sleep(1.0)  # the running job must not notice
        t_kill = run.kill(2)
        done = run.wait("six ranks stepping after host C was lost (host D a spare)",
                        lambda: run.stepping(6, t_kill + SPARE_GAP), RECOVERY_TIMEOUT)
        return done - t_kill
    finally:
        pids += run.close()


def _lose_the_store_host(hosts: "Hosts", launcher: str, base: Path, tag: str, pids: list[int],
                         backend: str = "c10d", endpoint: str | None = None,
                         also_kill: Callable[[], None] | None = None) -> str:
    """What happens when host A (the c10d store's host, or an etcd member's) is lost."""
    run = Run(hosts, launcher, base, tag, backend=backend, endpoint=endpoint)
    try:
        run.wait("six ranks stepping", lambda: run.stepping(6, 0.0), START_TIMEOUT)
        t_kill = run.kill(0)
        if also_kill is not None:
            also_kill()  # the host's etcd member dies with it
        deadline = t_kill + PROBE_TIMEOUT
        recovered = None
        while time.monotonic() < deadline:
            recovered = run.stepping(4, t_kill)
            ended = [a.poll() for a in run.agents[1:]]
            if recovered is not None or all(c is not None for c in ended):
                break
            time.sleep(0.1)
        ended = [a.poll() for a in run.agents[1:]]
        waited = time.monotonic() - t_kill
        if recovered is not None:
            return f"recovered: 4 ranks stepping {fmt(recovered - t_kill)} s after the kill"
        if all(c is not None for c in ended):
            return (f"did not recover: hosts B and C exited with codes {ended} within "
                    f"{fmt(waited)} s ({run.tail().split('; ')[1][:200]})")
        return (f"did not recover and did not exit: {PROBE_TIMEOUT:g} s after the kill hosts B "
                f"and C were still running without training (exit codes {ended})")
    finally:
        pids += run.close()


def run(cfg: RunConfig) -> BenchResult:
    sys.path.insert(0, str(ROOT))
    from tests.helpers.netns import Hosts, etcd_members, netns_works

    why = netns_works()
    if why is not None:
        raise BenchError(f"test hosts need network namespaces: {why}")
    rounds = 1 if cfg.quick else 5
    subjects = ["elastictk"] if cfg.quick else ["elastictk", "torchrun"]
    base = Path(tempfile.mkdtemp(prefix="elastictk-bench-multinode-"))
    pids: list[int] = []
    notes: list[str] = []
    rows: list[Comparison] = []
    counter = iter(range(1000))
    tags: list[str] = []  # each set of test hosts, for a teardown check that ignores other runs'
    try:
        with Hosts(3) as hosts:
            tags.append(hosts.tag)
            cfg.log(f"{rounds} round(s) of: 3 hosts, lose host C ({', '.join(subjects)})")
            got = interleaved(subjects, lambda s: _lose_a_host(hosts, s, base, f"{s}-{next(counter)}", pids),
                              rounds)
            if cfg.quick:
                notes.append(f"--quick: elastictk-run only, recovered in {fmt(got['elastictk'][0])} s; "
                             "torchrun and the store-host probes run in the full benchmark")
            else:
                rows.append(Comparison({"lost": "host C (not the store's)"},
                                       Measured("elastictk-run c10d", got["elastictk"]),
                                       Measured("torchrun c10d", got["torchrun"])))
                for launcher in ("elastictk", "torchrun"):
                    cfg.log(f"lose host A (the c10d store's host) under {launcher}")
                    what = _lose_the_store_host(hosts, launcher, base, f"{launcher}-store-{next(counter)}", pids)
                    notes.append(f"{launcher}, c10d, host A (the store's host) lost: {what}")
                cfg.log("lose host A under elastictk with a 3-member etcd cluster")
                etcd_dir = base / "etcd"
                etcd_dir.mkdir()
                members = etcd_members(hosts, etcd_dir)
                try:
                    pids += [m.pid for m in members if m.pid is not None]
                    endpoints = ",".join(f"{h.addr}:2379" for h in hosts)
                    what = _lose_the_store_host(hosts, "elastictk", base, f"etcd-{next(counter)}", pids,
                                                backend="etcd", endpoint=endpoints, also_kill=members[0].kill)
                finally:
                    for m in members:
                        m.close()
                notes.append("elastictk, etcd (one member per host), host A lost (its agent tree and its "
                             f"etcd member SIGKILLed at once; two members remain, a quorum): {what}")
        if not cfg.quick:
            with Hosts(4) as hosts4:
                tags.append(hosts4.tag)
                cfg.log(f"{rounds} round(s) of: lose host C with and without a spare on host D (elastictk)")
                arms = {"spare": _lose_a_host_with_a_spare, "none": _lose_a_host}
                got = interleaved(list(arms), lambda arm: arms[arm](
                    hosts4, "elastictk", base, f"elastictk-{arm}-{next(counter)}", pids), rounds)
                rows.append(Comparison({"lost": "host C: a spare on host D vs none"},
                                       Measured("elastictk-run, spare: 6 ranks again", got["spare"]),
                                       Measured("elastictk-run, no spare: 4 ranks again", got["none"])))
                cfg.log("lose host C with a spare on host D under torchrun (once)")
                try:
                    took = _lose_a_host_with_a_spare(hosts4, "torchrun", base, f"torchrun-spare-{next(counter)}", pids)
                    notes.append(f"torchrun, a spare on host D, host C lost: 6 ranks stepping {fmt(took)} s after the kill")
                except BenchError as e:
                    notes.append(f"torchrun, a spare on host D, host C lost: did not recover ({str(e)[:300]})")
    finally:
        if not os.environ.get("ELASTICTK_BENCH_KEEP"):
            shutil.rmtree(base, ignore_errors=True)
    notes.append("workers are tiny gloo all-reduce loops: the sample is the launchers' own "
                 "detection, rendezvous and restart, not a model's start-up")
    return BenchResult(
        name="multinode", title=TITLE, description=(__doc__ or "").strip(), unit="s",
        higher_is_better=False, rows=rows, notes=notes,
        params={"rounds": rounds, "hosts": 3, "nproc_per_node": 2, "elastictk_conf": ELASTICTK_CONF,
                "torchrun_conf": TORCH_CONF, "host_tags": tags},
        pids=pids,
    )

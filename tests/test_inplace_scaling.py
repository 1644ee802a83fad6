"""Nodes leave and join a ``--recovery in-place`` job while the survivors keep their processes.

Three (or two, then three) real agents on one file-store rendezvous, one worker each, running
``examples/train_inplace.py`` with ``--trace``: every rank logs the global sample indices of
every step it trained, so the test checks that each step's samples were covered exactly once
by the generation that committed it, whatever the world size was at that step.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
INPLACE = str(ROOT / "examples" / "train_inplace.py")
GLOBAL_BATCH = 32
STEPS = 30
CONF = "last_call_timeout=1,heartbeat_interval=0.2,heartbeat_timeout=3,join_timeout=60"


class Job:
    """Agents of one in-place job (file rendezvous: no store host to lose); reaps them all."""

    def __init__(self, tmp: Path, nnodes: str, steps: int = STEPS, restarts: int = 0,
                 rdzv: tuple[str, str, str] | None = None, conf: str = CONF) -> None:
        """``rdzv``: (backend, endpoint, job id); a file store under ``tmp`` by default."""
        self.conf = conf
        self.tmp = tmp
        self.rdzv = rdzv or ("file", str(tmp / "rdzv"), "scale")
        self.restarts = restarts
        self.nnodes = nnodes
        self.steps = steps
        self.trace = tmp / "trace.jsonl"
        self.record = tmp / "record.jsonl"
        self.agents: list[subprocess.Popen[str]] = []

    def start(self, *extra: str) -> subprocess.Popen[str]:
        i = len(self.agents)
        cmd = [sys.executable, "-m", "elastictk.run", "--nnodes", self.nnodes, "--nproc-per-node", "1",
               "--rdzv-backend", self.rdzv[0], "--rdzv-endpoint", self.rdzv[1], "--rdzv-id", self.rdzv[2],
               "--rdzv-conf", self.conf, "--max-restarts", str(self.restarts), "--recovery", "in-place",
               "--log-dir", str(self.tmp / f"logs{i}"), "--event-log", str(self.events(i)),
               INPLACE, "--steps", str(self.steps), "--step-time", "0.1", "--trace", str(self.trace),
               "--record", str(self.record), *extra]
        p = subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.agents.append(p)
        return p

    def events(self, i: int) -> Path:
        return self.tmp / f"events{i}.jsonl"

    def kinds(self, i: int) -> list[dict[str, Any]]:
        path = self.events(i)
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

    def round_rank(self, i: int) -> int | None:
        joined = [e for e in self.kinds(i) if e["kind"] == "round_joined"]
        return int(joined[-1]["fields"]["rank"]) if joined else None

    def trained(self) -> list[dict[str, Any]]:
        if not self.trace.exists():
            return []
        return [json.loads(x) for x in self.trace.read_text().splitlines() if x.strip()]

    def wait_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(t.get("step", -1) >= step for t in self.trained()):
                return
            if any(a.poll() is not None for a in self.agents):
                break
            time.sleep(0.1)
        raise AssertionError(f"no rank reached step {step}: {self.outputs()}")

    def finish(self, timeout: float = 180) -> list[str]:
        outs = []
        for a in self.agents:
            try:
                outs.append(a.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                a.kill()
                outs.append(a.communicate()[0])
        return outs

    def outputs(self) -> str:
        """Each agent's exit code and its last events (what it was doing when a wait ran out)."""
        return " | ".join(f"agent {i} rc={a.poll()} last events: "
                          + ", ".join(f"{e['kind']} {e.get('fields', {})}" for e in self.kinds(i)[-6:])
                          for i, a in enumerate(self.agents))

    def close(self) -> None:
        for a in self.agents:
            if a.poll() is None:
                a.kill()
            a.communicate()


def check_samples(trace: list[dict[str, Any]], n: int = STEPS) -> dict[int, int]:
    """Every step's samples were trained exactly once by the generation that committed it;
    returns step → world size at that step."""
    steps = [t for t in trace if "step" in t]
    worlds: dict[int, int] = {}
    for s in range(n):
        rows = [t for t in steps if t["step"] == s]
        assert rows, f"step {s} never trained"
        last = max(t["gen"] for t in rows)
        final = [t for t in rows if t["gen"] == last]
        world = final[0]["world"]
        assert sorted(t["rank"] for t in final) == list(range(world)), (s, final)
        covered = sorted(i for t in final for i in range(*t["samples"]))
        assert covered == list(range(GLOBAL_BATCH)), f"step {s}: samples {covered}"
        worlds[s] = world
    return worlds


def final_weights(trace: list[dict[str, Any]]) -> list[float]:
    finals = [t["final"] for t in trace if "final" in t]
    assert len(finals) == 1, finals
    return finals[0]


def fault_free(tmp: Path, steps: int) -> list[float]:
    """The weights of a fault-free single-node run (3 workers)."""
    trace = tmp / f"trace{steps}.jsonl"
    r = subprocess.run([sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "3",
                        "--log-dir", str(tmp / f"logs{steps}"), INPLACE, "--steps", str(steps),
                        "--step-time", "0", "--trace", str(trace)],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return final_weights([json.loads(x) for x in trace.read_text().splitlines()])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return fault_free(tmp_path_factory.mktemp("ref"), STEPS)


def close_to(a: list[float], b: list[float]) -> bool:
    """Equal up to the order of float64 sums (an all-reduce over another world size)."""
    return len(a) == len(b) and all(abs(x - y) <= 1e-9 * max(1.0, abs(y)) for x, y in zip(a, b))


def pids_of(record: Path) -> dict[int, set[int]]:
    """Generation → PIDs of the workers that formed it."""
    out: dict[int, set[int]] = {}
    for line in record.read_text().splitlines():
        r = json.loads(line)
        out.setdefault(r["gen"], set()).add(r["pid"])
    return out


def test_a_lost_node_shrinks_the_world_in_place(tmp_path: Path, reference: list[float]) -> None:
    """SIGKILL one of three agents (its worker dies with it): the other two keep their worker
    processes, re-form at world size 2 with new ranks, and finish without spending a restart."""
    # The three start together and must form the first round together: with a 1 s last call a
    # loaded host started the third after two had closed a round of 2 (step 0 trained at world 2,
    # then again at 3 by fresh workers). A round closes at once when all three are in, so the
    # longer last call costs only the re-form after the loss (it waits that long for a third).
    job = Job(tmp_path, "2:3", conf=CONF.replace("last_call_timeout=1", "last_call_timeout=8"))
    try:
        for _ in range(3):
            job.start()
        job.wait_step(8)
        ranks = {i: job.round_rank(i) for i in range(3)}
        victim = next(i for i, r in ranks.items() if r == 1)  # not the in-place store's host
        os.kill(job.agents[victim].pid, signal.SIGKILL)
        outs = job.finish()
    finally:
        job.close()
    survivors = [i for i in range(3) if i != victim]
    assert [job.agents[i].returncode for i in survivors] == [0, 0], [outs[i][-3000:] for i in survivors]
    worlds = check_samples(job.trained())
    assert worlds[0] == 3 and worlds[STEPS - 1] == 2, worlds
    assert close_to(final_weights(job.trained()), reference)
    for i in survivors:
        kinds = [e["kind"] for e in job.kinds(i)]
        told = [f"{e['kind']} {e.get('fields', {})}" for e in job.kinds(i)]
        assert kinds.count("workers_started") == 1, told  # never restarted
        assert "workers_kept" in kinds and "inplace_resized" in kinds, told
        done = [e for e in job.kinds(i) if e["kind"] == "job_finished"]
        assert done and done[0]["fields"]["restarts"] == 0
    gens = pids_of(job.record)
    assert gens[max(gens)] < gens[0], gens  # the survivors' own processes formed the last one


@pytest.mark.timeout(900)  # waits for a newcomer whose start-up takes minutes on a loaded host
def test_a_joining_node_grows_the_world_in_place(tmp_path: Path) -> None:
    """Two agents train; a third joins: the two keep their processes and, at a commit point,
    re-form at world size 3 with the newcomer, which gets the state from them. The two train
    on while the newcomer's agent starts its workers."""
    # The job ends 10 steps after the world reaches 3, not after a step count guessed to outlast
    # the newcomer's start-up (seconds idle, a minute on a loaded host: the world stayed 2);
    # 3000 steps (5 minutes at 0.1 s) only bound a join that never comes.
    job = Job(tmp_path, "2:3", 3000)
    try:
        job.start("--until-world", "3:10")
        job.start("--until-world", "3:10")
        job.wait_step(6)
        job.start("--until-world", "3:10")
        outs = job.finish(timeout=600)
    finally:
        job.close()
    assert [a.returncode for a in job.agents] == [0, 0, 0], [o[-3000:] for o in outs]
    steps = 1 + max(t["step"] for t in job.trained() if "step" in t)
    worlds = check_samples(job.trained(), steps)
    assert worlds[0] == 2 and worlds[steps - 1] == 3 and steps < 3000, worlds
    assert close_to(final_weights(job.trained()), fault_free(tmp_path, steps))
    for i in (0, 1):
        kinds = [e["kind"] for e in job.kinds(i)]
        assert kinds.count("workers_started") == 1 and "workers_kept" in kinds, kinds
    gens = pids_of(job.record)
    assert gens[0] < gens[max(gens)] and len(gens[max(gens)]) == 3, gens
    joined = [t for t in job.trained() if t.get("world") == 3 and t["pid"] not in gens[0]]
    assert joined and min(t["step"] for t in joined) > 6  # the newcomer did not start over


def test_a_node_joining_as_the_job_ends_finishes_with_it(tmp_path: Path, reference: list[float]) -> None:
    """A third agent arrives during the last steps: whether the world grows for the last
    commit or the job ends first (its workers then exit at once), every agent exits 0 and
    every step was trained exactly once."""
    job = Job(tmp_path, "2:3")
    try:
        job.start()
        job.start()
        job.wait_step(STEPS - 3)
        job.start()
        outs = job.finish(timeout=120)
    finally:
        job.close()
    assert [a.returncode for a in job.agents] == [0, 0, 0], [o[-3000:] for o in outs]
    check_samples(job.trained())
    assert close_to(final_weights(job.trained()), reference)


def test_the_end_and_a_new_generation_race_for_one_record(tmp_path: Path) -> None:
    """Rank 0 ending the job and an agent publishing the next generation write the same record
    once: whichever comes first wins, and a worker waiting for that generation either joins
    it or learns the job is over (and exits 0)."""
    import datetime

    import torch.distributed as dist

    from elastictk.inplace import State
    from elastictk.inplace.session import Context, Session
    from elastictk.inplace.protocol import Generation, gen_key
    from elastictk.store import TCPStore as Server

    server = Server.serve("127.0.0.1", 0)
    raw = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                        timeout=datetime.timedelta(seconds=10), use_libuv=True)
    store = dist.PrefixStore("job", raw)
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", raw), rank=0, world_size=1)
        ending = Session("gloo", 10, 0, 1, store, node="a")
        assert ending.finish(Context(0, 1, generation=0)) is True  # nobody published gen 1
        late = Generation(1, 2, nodes={"a": 0, "b": 1}).to_json()
        assert server.compare_set(f"job/{gen_key(1)}", None, late) != late  # the agent lost
        joiner = Session("gloo", 10, 1, 2, store, node="b", first_gen=1)
        with pytest.raises(SystemExit) as ended:
            joiner.join(State(step=0), after=None)
        assert ended.value.code == 0
        # The other order: the generation is there first, so the ranks go on into it.
        assert server.compare_set(f"job/{gen_key(2)}", None,
                                  Generation(2, 1, nodes={"a": 0}).to_json()) is not None
        assert ending.finish(Context(0, 1, generation=1)) is False
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        del store, raw
        server.close()


def test_losing_the_in_place_stores_host_restarts_the_job(tmp_path: Path, reference: list[float]) -> None:
    """The agent hosting the in-place store is SIGKILLed: the kept workers cannot re-form, so
    the job restarts as restart-all would (one restart charged) and still finishes."""
    # Three from the start (a 1 s last call let a loaded host close a round of two first, and
    # the third's arrival re-formed it: one start more than the test is about).
    job = Job(tmp_path, "2:3", restarts=2, conf=CONF.replace("last_call_timeout=1", "last_call_timeout=8"))
    try:
        for _ in range(3):
            job.start()
        job.wait_step(8)
        host = next(i for i in range(3) if job.round_rank(i) == 0)
        os.kill(job.agents[host].pid, signal.SIGKILL)
        outs = job.finish()
    finally:
        job.close()
    survivors = [i for i in range(3) if i != host]
    assert [job.agents[i].returncode for i in survivors] == [0, 0], [outs[i][-3000:] for i in survivors]
    assert close_to(final_weights(job.trained()), reference)
    assert any(e["kind"] == "inplace_fallback" for i in survivors for e in job.kinds(i))
    for i in survivors:
        kinds = [e["kind"] for e in job.kinds(i)]
        changed = [e["fields"] for e in job.kinds(i) if e["kind"] == "membership_changed"]
        assert kinds.count("workers_started") == 2, (kinds, changed)
        done = [e for e in job.kinds(i) if e["kind"] == "job_finished"]
        assert done and done[0]["fields"]["restarts"] == 1  # one failure, one restart

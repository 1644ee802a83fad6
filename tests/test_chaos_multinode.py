"""elastictk-chaos with several nodes: real agents on loopback (c10d hosted by node 0, or a real
etcd), real SIGKILLs of agents and a real SIGSTOP of the store; plus the pure pieces."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastictk.chaos.expect import BUDGET, STORE, Shape, expect
from elastictk.chaos.multinode import agents_up_at, full_size_at, tag_events, workers_by_rank
from elastictk.faults import Fault, PlanError, generate_plan, plan_of
from elastictk.testing.etcd import EtcdNotInstalled, find_etcd
from tests.helpers.chaosrun import chaos as run_chaos
from tests.helpers.chaosrun import report

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "examples" / "train.py")
STEPS = str(ROOT / "tests" / "helpers" / "chaos_steps_worker.py")
CONF = "last_call_timeout=2,heartbeat_interval=0.2,heartbeat_timeout=1.5,join_timeout=20"


def chaos(tmp: Path, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return run_chaos(tmp, *args, timeout=timeout)


def planned(tmp: Path, *faults: Fault) -> str:
    plan_of(list(faults)).save(tmp / "plan.json")
    return "plan.json"


def test_a_lost_agent_is_a_membership_change_and_the_survivors_finish(tmp_path: Path) -> None:
    plan = planned(tmp_path, Fault.of("kill-agent", "node:2", at_s=1))
    r = chaos(tmp_path, "--nodes", "3", "--nnodes", "2:3", "--plan", plan, "--nproc-per-node", "1",
              "--max-restarts", "0", "--rdzv-conf", CONF, "--", STEPS, "--steps", "40", "--step-time", "0.1")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    d = report(tmp_path)
    assert d["totals"]["exit_code"] == 0 and d["totals"]["restarts"] == 0, "no restart charged for a lost node"
    (row,) = d["faults"]
    assert row["outcome"] == "membership change" and row["detected_after"] < row["running_after"]
    assert [(a["node"], a["killed"]) for a in d["agents"]] == [(0, False), (1, False), (2, True)]
    assert "[ok] each lost node is seen by every survivor" in r.stdout and "node 2 pid" in r.stdout
    assert d["multinode"] == {"nodes": 3, "backend": "c10d", "rejoin_s": None}


@pytest.mark.timeout(600)  # the run's own deadline is 480 s: its agents start in minutes on a loaded host
def test_a_short_c10d_outage_is_ridden_through_and_a_lost_node_rejoins(tmp_path: Path) -> None:
    # Under c10d the store lives in node 0's agent: the outage is a SIGSTOP of that agent.
    # A world of one takes no step (--hold-below-world 2): node 1's agent starts a minute late on
    # a loaded host, and node 0 alone (--nnodes 1:2) used to run the whole job before it came, so
    # the faults, timed from the full world, never fired; likewise the rejoined node.
    # Heartbeat timeout 5 s, not the module's 1.5 s: at a load average of 66 node 0's own beat
    # went unsent for 1.8 s, so its fence stopped it (exit 1) while it waited for the rejoin.
    # The node rejoins 7 s after its kill, past the survivor's 5 s to see it lost, and the
    # survivor still trains then (120 steps), so the loss is a membership change, idle or loaded.
    conf = CONF.replace("heartbeat_timeout=1.5", "heartbeat_timeout=5")
    plan = planned(tmp_path, Fault.of("store-outage:1", "store", at_s=1), Fault.of("kill-agent", "node:1", at_s=3))
    r = chaos(tmp_path, "--nodes", "2", "--nnodes", "1:2", "--plan", plan, "--rejoin", "7", "--nproc-per-node", "1",
              "--max-restarts", "0", "--rdzv-conf", conf, "--", STEPS, "--steps", "120", "--step-time", "0.1",
              "--hold-below-world", "2", timeout=480)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    d = report(tmp_path)
    assert [f["outcome"] for f in d["faults"]] == ["ridden through", "membership change"], d["faults"]
    assert d["totals"]["restarts"] == 0 and d["totals"]["exit_code"] == 0
    assert [(a["node"], a["agent"], a["killed"]) for a in d["agents"]] == [(0, 0, False), (1, 0, True), (1, 1, False)]
    assert [x["node"] for x in d["rejoins"]] == [1]
    png = (tmp_path / "r" / "chaos-timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


def test_a_lost_agent_of_a_gloo_job_over_the_budget_fails_with_the_budget_message(tmp_path: Path) -> None:
    # The survivors' workers break in all_reduce before the heartbeat says the node is gone: a
    # failure, charged to --max-restarts 0, so the job must fail naming the spent budget.
    # The first round waits for both nodes (a round closes at once when full; the long last call
    # only bounds a node that never comes): node 1's agent started 20 s late on a loaded host and
    # node 0 alone had run the whole job, so the fault never fired. A 10 s heartbeat timeout keeps
    # the broken all_reduce first on a loaded host too.
    conf = CONF.replace("last_call_timeout=2", "last_call_timeout=600").replace("heartbeat_timeout=1.5",
                                                                                "heartbeat_timeout=10")
    plan = planned(tmp_path, Fault.of("kill-agent", "node:1", at_s=1))
    r = chaos(tmp_path, "--nodes", "2", "--nnodes", "1:2", "--plan", plan, "--nproc-per-node", "1",
              "--max-restarts", "0", "--rdzv-conf", conf, "--", TRAIN, "--steps", "200", "--step-time", "0.05",
              "--ckpt-dir", "{run_dir}", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]  # failing was the right outcome
    d = report(tmp_path)
    assert d["totals"]["exit_code"] == 1 and d["faults"][0]["outcome"] == "restart"
    names = {c["name"]: c["ok"] for c in d["checks"]}
    assert names["fails naming the spent budget"] and names["finishes iff the budget and the nodes left allow it"]


def test_a_short_etcd_outage_is_ridden_through(tmp_path: Path) -> None:
    try:
        find_etcd()
    except EtcdNotInstalled as e:
        pytest.skip(str(e))
    plan = planned(tmp_path, Fault.of("store-outage:1.5", "store", at_s=0.5))
    r = chaos(tmp_path, "--nodes", "2", "--nnodes", "2", "--rdzv-backend", "etcd", "--plan", plan,
              "--nproc-per-node", "1", "--max-restarts", "0",
              "--rdzv-conf", "last_call_timeout=2,heartbeat_interval=0.3,heartbeat_timeout=4,join_timeout=20",
              "--", TRAIN, "--steps", "60", "--step-time", "0.05", "--ckpt-dir", "{run_dir}")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    d = report(tmp_path)
    assert d["faults"][0]["outcome"] == "ridden through" and d["totals"]["restarts"] == 0
    assert d["totals"]["exit_code"] == 0 and d["totals"]["checksum"]
    assert "[ok] a store outage < heartbeat timeout 4s is ridden through" in r.stdout


def test_multinode_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    cmd = ["--", STEPS]
    for args, text in [
        (["--nodes", "2", "--rdzv-endpoint", "127.0.0.1:1", *cmd], "--rdzv-endpoint: with --nodes"),
        (["--nodes", "3", "--nnodes", "1:2", *cmd], "--nodes 3 with --nnodes 1:2"),
        (["--nodes", "2", "--rdzv-backend", "file", *cmd], "with --nodes use one of c10d, etcd"),
        (["--rejoin", "1", "--standalone", *cmd], "--rejoin and --kill-store-host need several nodes"),
        (["--nodes", "2", "--kinds", "kill-agent", *cmd], "cannot be triggered by step"),
        (["--nodes", "2", "--at-seconds", "x", *cmd], "--at-seconds 'x': write LO:HI"),
    ]:
        r = chaos(tmp_path, *args, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and text in lines[0], (args, r.stderr)
    planned(tmp_path, Fault.of("kill-agent", "node:3", at_s=1))
    r = chaos(tmp_path, "--nodes", "2", "--plan", "plan.json", *cmd, timeout=60)
    assert r.returncode == 2 and "the job has nodes 0..1" in r.stderr


# -- pure pieces -------------------------------------------------------------------------------
def test_generated_kill_agent_spares_the_c10d_store_host() -> None:
    knobs = dict(kinds=["kill-agent"], seconds=(1, 60), min_gap_s=6, nodes=3, spare_nodes=(0,), rejoin_s=0)
    plan = generate_plan(3, 6, 3, **knobs)
    assert {f.target.index for f in plan.faults} <= {1, 2}
    again = generate_plan(3, 6, 3, **knobs)
    assert again == plan


def test_a_killed_node_is_aimed_at_again_only_once_it_has_rejoined() -> None:
    """With --rejoin, a node killed at t runs again from t + rejoin + the margin: a later kill
    may hit it from then on, never before; without --rejoin, never again in the plan."""
    from elastictk.faults.knobs import REJOIN_MARGIN_S

    for seed in range(40):
        plan = generate_plan(seed, 5, 3, kinds=["kill-agent"], seconds=(1, 80), min_gap_s=7, nodes=3,
                             spare_nodes=(0,), rejoin_s=2)
        back: dict[int, float] = {}
        for f in plan.faults:
            assert f.at_s is not None and f.target.index is not None
            assert back.get(f.target.index, 0.0) <= f.at_s, (seed, plan.faults)
            back[f.target.index] = f.at_s + 2 + REJOIN_MARGIN_S
    with pytest.raises(PlanError, match="more kill-agent faults than nodes"):
        generate_plan(3, 3, 3, kinds=["kill-agent"], seconds=(1, 80), min_gap_s=4, nodes=3, spare_nodes=(0,))


def test_ranks_map_to_the_workers_each_node_runs_now() -> None:
    from elastictk.metrics.events import Event  # tag_events copies with dataclasses.replace

    per = [(0, [Event("round_joined", {"rank": 1}, mono=1), Event("workers_started", {"pids": {"0": 10, "1": 11},
                                                                                     "world_size": 4}, mono=2)]),
           (1, [Event("round_joined", {"rank": 0}, mono=1.5), Event("workers_started", {"pids": {"0": 20, "1": 21},
                                                                                       "world_size": 4}, mono=3)])]
    events = tag_events(per)
    assert [e.fields["node"] for e in events] == [0, 1, 0, 1]
    assert workers_by_rank(events, 2) == {0: (1, 20), 1: (1, 21), 2: (0, 10), 3: (0, 11)}
    assert full_size_at(events, 4, 2) == 3 and full_size_at(events[:3], 4, 2) is None
    stopped = tag_events([(1, [Event("workers_stopped", {}, mono=4)])])
    assert workers_by_rank(events + stopped, 2) == {2: (0, 10), 3: (0, 11)}


def test_the_full_size_wait_counts_from_the_last_agent_up_not_from_the_start() -> None:
    """A loaded host starts an agent a minute late: the wait for a full world (after which time
    faults fire anyway) counts from when the last agent got past its start-up, or exited."""
    from elastictk.metrics.events import Event

    events = tag_events([(0, [Event("rendezvous_started", {}, mono=2), Event("workers_started", {}, mono=5)]),
                         (1, [Event("rendezvous_started", {}, mono=70)])])
    assert agents_up_at(events, 2) == 70
    assert agents_up_at(events[:2], 2) is None  # node 1 still importing: no wait started
    assert agents_up_at(events[:2], 2, exited=[1]) == 2  # node 1 exited: up as far as waiting goes
    assert agents_up_at(events, 3) is None


shapes = st.builds(Shape, nodes=st.integers(2, 6), min_nodes=st.integers(1, 6), backend=st.sampled_from(["c10d", "etcd"]),
                   max_restarts=st.integers(0, 4), heartbeat_timeout=st.floats(0.5, 20), rejoin=st.booleans())


@given(shape=shapes, needed=st.integers(0, 6), killed=st.sets(st.integers(0, 5), max_size=4),
       outages=st.lists(st.floats(0.1, 30), max_size=3))
def test_the_expected_outcome_follows_the_rules(shape: Shape, needed: int, killed: set[int],
                                                outages: list[float]) -> None:
    killed = {k for k in killed if k < shape.nodes}
    e = expect(shape, needed, killed, outages)
    host_lost = shape.backend == "c10d" and 0 in killed
    left = shape.nodes if shape.rejoin else shape.nodes - len(killed)
    if host_lost:
        assert e.finish is False and e.names == STORE
    elif left < shape.min_nodes:
        assert e.finish is False
    elif needed > shape.max_restarts:
        assert e.finish is False and e.names == BUDGET
    elif any(s >= shape.heartbeat_timeout for s in outages):
        assert e.finish is None
    else:
        assert e.finish is True
    # More failures never turn a failure into a finish; fewer never the other way.
    if e.finish is False:
        assert expect(shape, needed + 1, killed, outages).finish is False
    if e.finish is True and needed:
        assert expect(shape, needed - 1, killed, outages).finish is True
    # Short outages and etcd's node 0 are nothing special.
    short = [s for s in outages if s < shape.heartbeat_timeout]
    assert expect(shape, needed, killed, short).finish in (True, False)


def _outage_row(reason: str, cause: str = "lost_node") -> dict:
    """The row of a 3.7 s store outage at t=11 that came 2.6 s after node 2's agent was killed,
    with the survivors' one membership change at t=14.9 (seen in a seeded in-place run)."""
    from elastictk.chaos.nodereport import node_fault
    from elastictk.chaos.record import Injection, RunRecord
    from elastictk.metrics.events import Event

    rec = RunRecord(argv=[], started=0.0)
    rec.injections = [Injection(0, "kill-agent", "node:2", 8.5, None, how="outside"),
                      Injection(1, "store-outage", "store", 11.1, None, how="outside")]
    rec.events = tag_events([
        (n, [Event("workers_started", {"world_size": 3}, mono=1.0, node_id=f"vm-{n}")]) for n in range(3)
    ] + [(n, [Event("membership_changed", {"reason": reason, "cause": cause}, mono=14.9 + n / 100,
                    node_id=f"vm-{n}")]) for n in (0, 1)])
    shape = Shape(nodes=3, min_nodes=2, backend="c10d", max_restarts=2, heartbeat_timeout=6.0)
    return node_fault(Fault(kind="store-outage", target="store", param="3.7", at_s=4.8), rec.injections[1], rec, shape)


def test_the_notice_of_a_node_killed_before_an_outage_is_not_the_outages_doing() -> None:
    assert _outage_row("node vm-2 (rank 2) lost: no heartbeat for 6.8s")["outcome"] == "ridden through"
    # The failing side: a member the outage itself cost (not the killed one) is still the outage's.
    row = _outage_row("node vm-1 (rank 1) lost: no heartbeat for 6.8s")
    assert row["outcome"] == "membership change" and round(row["detected_after"], 2) == 3.8
    assert _outage_row("node vm-2 (rank 2) lost", cause="store_error")["outcome"] == "membership change"

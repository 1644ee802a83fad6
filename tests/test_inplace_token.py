"""``--recovery in-place`` with ``--rdzv-token`` (issue #17): the in-place path charges the same
sealed restart state as restart-all, and a forged state is not believed."""
from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import pytest

from elastictk.agent.coordination import restart_count
from elastictk.agent.inplace import spend_restart
from elastictk.agent.policy import RestartPolicy
from elastictk.rendezvous import RendezvousHandler
from elastictk.store import FileStore, quiet_port
from tests.test_inplace_scaling import CONF, Job, check_samples, close_to, fault_free, final_weights
from tests.test_rendezvous import fast

TOKEN = "s3cret-token"


def test_the_inplace_charge_is_sealed_and_a_forged_reset_is_not_believed(tmp_path: Path) -> None:
    from elastictk.agent.coordination import Budget

    store = FileStore(tmp_path / "rdzv", timeout=20)
    h = RendezvousHandler(FileStore(tmp_path / "rdzv", timeout=20), fast("ip", 1, 1, token=TOKEN), node_id="a")
    try:
        h.next_round()
        budget = Budget(h.records)
        policy = RestartPolicy(max_restarts=5)
        assert [spend_restart(budget, policy, "boom").restart_count for _ in range(2)] == [1, 2]
        # restart-all's signed read accepts what the in-place path wrote
        assert restart_count(h.store, h.signer, h.prefix) == 2
        state = json.loads(store.try_get("rdzv/ip/policy") or b"{}")
        assert "mac" in state
        state.pop("mac")
        state["failures"] = 0
        store.set("rdzv/ip/policy", json.dumps(state).encode())  # a stranger resets the count
        assert budget.restart_count() == 2
        assert spend_restart(budget, policy, "again").restart_count == 3, "charged on, not from 0"
    finally:
        h.close()
        store.close()


def test_two_nodes_with_a_token_recover_in_place_twice_then_lose_a_node(tmp_path: Path) -> None:
    os.environ["ELASTICTK_RDZV_TOKEN"] = TOKEN  # inherited by both agents (not by their workers)
    # The crashes are planned for ranks 0 and 1 of a 2-node first round: with --nnodes 1:2 and
    # a 1 s last call, a loaded machine started the second agent late and the first trained alone
    # (8 s: the second agent's start on a loaded machine; the survivor waits it once more, alone).
    job = Job(tmp_path, "1:2", steps=60, restarts=5, conf=CONF.replace("last_call_timeout=1", "last_call_timeout=8"))
    try:
        crash = ("--crash", "5:0", "--crash", "12:1")  # one worker on each node, once each
        job.start(*crash)
        job.start(*crash)
        job.wait_step(22, timeout=240)
        assert [e["fields"]["world"] for e in job.kinds(0) if e["kind"] == "round_joined"][:1] == [2], \
            "both nodes are in the first round"
        survivor = 0 if job.round_rank(0) == 0 else 1
        victim = job.agents[1 - survivor]
        victim.send_signal(signal.SIGKILL)
        outs = job.finish(timeout=240)
        assert job.agents[survivor].returncode == 0, outs[survivor][-3000:]
        assert "not signed" not in outs[survivor], outs[survivor][-3000:]
        kinds = job.kinds(survivor)
        recovered = [e for e in kinds if e["kind"] == "inplace_recovery"]
        finished = [e for e in kinds if e["kind"] == "job_finished"]
        assert finished and finished[-1]["fields"]["restarts"] == 2, (recovered, finished)
        check_samples(job.trained(), 60)
    finally:
        os.environ.pop("ELASTICTK_RDZV_TOKEN", None)
        job.close()


FALLBACK_STEPS = 40


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return fault_free(tmp_path_factory.mktemp("ref"), FALLBACK_STEPS)


@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_two_nodes_with_a_token_recover_in_place_twice_then_fall_back(
        tmp_path: Path, backend: str, request: pytest.FixtureRequest, reference: list[float]) -> None:
    """Two agents on loopback, ``--rdzv-token`` and ``--recovery in-place``, over the c10d and
    etcd rendezvous: a worker on each node dies once (two in-place recoveries, charged 1 and
    2), then the second replacement dies while its generation forms, so the agent falls back to
    restart-all on the charge already made. The budget reads 2 at the end on both nodes, no
    sealed record of the job's own is rejected, and the weights are a fault-free run's."""
    endpoint = (f"127.0.0.1:{quiet_port()}" if backend == "c10d"
                else request.getfixturevalue("etcd_server").endpoint)
    rdzv = (backend, endpoint, f"tok-{backend}-{uuid.uuid4().hex[:8]}")
    os.environ["ELASTICTK_RDZV_TOKEN"] = TOKEN  # inherited by both agents (not by their workers)
    job = Job(tmp_path, "2", steps=FALLBACK_STEPS, restarts=5, rdzv=rdzv)
    try:
        faults = ("--crash", "5:0", "--crash", "12:1", "--crash-at-start", f"2:{tmp_path / 'started-once'}")
        job.start(*faults)
        job.start(*faults)
        outs = job.finish(timeout=240)
        assert [a.returncode for a in job.agents] == [0, 0], [o[-3000:] for o in outs]
        for out in outs:
            assert "not signed" not in out and "ignored" not in out, out[-3000:]
        kinds = [e for i in range(2) for e in job.kinds(i)]
        names = [e["kind"] for e in kinds]
        assert (tmp_path / "started-once").exists(), "the replacement's fault fired"
        assert names.count("inplace_recovery") == 2, names
        assert "inplace_fallback" in names, names
        restarts = [e["fields"]["restart_count"] for e in kinds if e["kind"] == "restart"]
        assert restarts and set(restarts) == {2}, ("the fallback restarts on the charge made", restarts)
        finished = [e["fields"]["restarts"] for e in kinds if e["kind"] == "job_finished"]
        assert finished == [2, 2], finished
        # The restart-all attempt (no checkpoint in this example) trains every step again.
        trace = job.trained()
        last = {t["pid"] for t in trace if t.get("step") == FALLBACK_STEPS - 1}
        check_samples([t for t in trace if t.get("pid") in last], FALLBACK_STEPS)
        assert close_to(final_weights(trace), reference)
    finally:
        os.environ.pop("ELASTICTK_RDZV_TOKEN", None)
        job.close()

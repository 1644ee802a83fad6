"""The job token: only nodes that know it join, and nothing a stranger writes is believed.

Property tests for the signing itself; then real handlers and coordinators over each real
store (c10d TCPStore, FileStore, etcd), with a stranger that writes straight into the store.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastictk.rendezvous import (
    MembershipWatch, RendezvousAuthError, RendezvousHandler, RendezvousStateError,
)
from elastictk.rendezvous.auth import Signer
from elastictk.rendezvous.records import NodeRecord, RoundResult, decode_node, decode_result, slot_key
from elastictk.store import Store
from elastictk.agent.coordination import Decision, RoundCoordinator, restart_count
from elastictk.agent.policy import RestartPolicy
from tests import test_rendezvous as _rdzv
from tests.test_rendezvous import fast, infos, join_all

TOKEN = "s3cret-token"
json_scalars = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=8)
bodies = st.dictionaries(st.text(min_size=1, max_size=6).filter(lambda k: k != "mac"),
                         st.recursive(json_scalars, lambda c: st.lists(c, max_size=3)
                                      | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=6),
                         max_size=5)


@given(bodies, st.text(max_size=20), st.text(min_size=1, max_size=10))
def test_sealed_records_verify_and_survive_a_json_round_trip(body: dict[str, Any], key: str, token: str) -> None:
    signer = Signer(token)
    sealed = json.loads(json.dumps(signer.seal(key, body), sort_keys=True))
    assert signer.verify(key, sealed)
    assert Signer(None).verify(key, body), "without a token nothing is checked"


@given(bodies, st.text(max_size=20), st.text(min_size=1, max_size=10), st.data())
def test_any_change_to_a_sealed_record_is_caught(body: dict[str, Any], key: str, token: str, data: st.DataObject) -> None:
    signer = Signer(token)
    sealed = signer.seal(key, body)
    assert not signer.verify(key + "x", sealed), "a record cannot be replayed under another key"
    assert not Signer(token + "x").verify(key, sealed), "another token does not verify it"
    assert not signer.verify(key, body), "an unsigned record is not accepted"
    if body:
        field = data.draw(st.sampled_from(sorted(body)))
        forged = dict(sealed, **{field: [body[field], "forged"]})
        assert not signer.verify(key, forged)


def test_forged_and_garbled_records_are_rejected_naming_the_key() -> None:
    key = "rdzv/job/r/3/result"
    good = Signer(TOKEN)
    forged = RoundResult(3, ()).to_json(Signer("guess"), key)
    with pytest.raises(RendezvousAuthError, match="rdzv/job/r/3/result") as e:
        decode_result(key, forged, good)
    assert "\n" not in str(e.value) and "--rdzv-token" in str(e.value)
    with pytest.raises(RendezvousAuthError, match="rdzv/job/r/3/result"):
        decode_result(key, RoundResult(3, ()).to_json(), good)  # unsigned
    # With a token, bytes are refused by their MAC before any parser sees them...
    with pytest.raises(RendezvousAuthError, match="rdzv/job/r/3/slot/1.*garbled"):
        decode_node("rdzv/job/r/3/slot/1", b"\x80\x04\x95pickle", good)
    # ...without one, the parser names what is wrong, in one line.
    with pytest.raises(RendezvousStateError, match="rdzv/job/r/3/slot/1.*not JSON.*UTF-8") as bad:
        decode_node("rdzv/job/r/3/slot/1", b"\x80\x04\x95pickle")
    assert "\n" not in str(bad.value)
    ok = NodeRecord("n", {"a": 1}).to_json(good, "rdzv/job/r/3/slot/1")
    assert decode_node("rdzv/job/r/3/slot/1", ok, good) == NodeRecord("n", {"a": 1})


connect_store = _rdzv.connect  # fixtures: one store of each backend (tcp, file, etcd)
server = _rdzv.server


@pytest.mark.parametrize("theirs,mine,why", [
    (TOKEN, "wrong", "is not the job's"),
    (TOKEN, None, "requires a token"),
    (None, TOKEN, "without a token"),
])
def test_a_node_that_does_not_know_the_token_is_refused(connect_store: Callable[[], Store], theirs: str | None,
                                                         mine: str | None, why: str) -> None:
    members = [RendezvousHandler(connect_store(), fast("tok", 2, 3, token=theirs), node_id=n) for n in "ab"]
    stranger = RendezvousHandler(connect_store(), fast("tok", 2, 3, token=mine), node_id="stranger")
    try:
        first = infos(join_all(members))
        watch = MembershipWatch(members[0], first["a"])
        with pytest.raises(RendezvousAuthError, match=why) as e:
            stranger.next_round()
        assert "refused" in str(e.value) and "rdzv/tok/auth" in str(e.value) and "\n" not in str(e.value)
        assert not watch.wait(1.0), "the refused node changed nothing: no new round"
        watch.stop()
        assert connect_store().try_get("rdzv/tok/r/2/arrivals") is None
    finally:
        for h in [*members, stranger]:
            h.close()


def test_a_forged_join_neither_wakes_the_job_nor_gets_a_rank(connect_store: Callable[[], Store]) -> None:
    cfg = fast("forge", 2, 3, token=TOKEN, last_call=0.3)
    a, b, c = (RendezvousHandler(connect_store(), cfg, node_id=n) for n in "abc")
    raw = connect_store()
    try:
        first = infos(join_all([a, b]))
        watch = MembershipWatch(a, first["a"])
        # A stranger with store access writes a join record for round 2 without the token.
        seq = raw.add("rdzv/forge/r/2/arrivals", 1)
        raw.set(f"rdzv/forge/{slot_key(2, seq)}", NodeRecord("mallory", {}).to_json(Signer("guess"), "x"))
        raw.set("rdzv/forge/lost/b", json.dumps({"schema": "elastictk.rdzv/1", "by": "mallory"}).encode())
        assert not watch.wait(1.0), "a stranger's arrival does not make the job re-form"
        assert a._lost() == set(), "a forged lost/ note is not believed"
        result: dict[str, Any] = {}
        joiner = threading.Thread(target=lambda: result.update(join_all([c])))
        joiner.start()  # a real node arrives: now the job re-forms
        assert watch.wait(20), "a signed arrival does wake the job"
        watch.stop()
        second = join_all([a, b])
        joiner.join(60)
        later = infos(second | result)
        members = {m.node_id for m in later["a"].members}
        assert members == {"a", "b", "c"} and "mallory" not in members
    finally:
        for h in (a, b, c):
            h.close()
        raw.close()


def test_strangers_cannot_spend_the_budget_or_fake_a_failure(connect_store: Callable[[], Store]) -> None:
    cfg = fast("budget", 1, 1, token=TOKEN)
    h = RendezvousHandler(connect_store(), cfg, node_id="a")
    raw = connect_store()
    try:
        info = h.next_round()
        coord = RoundCoordinator(h.store, info.store, "a", on_failure=lambda: None,
                                 signer=h.signer, where=(h.prefix, info.store_prefix))
        raw.set(f"{info.store_prefix}/failed", json.dumps({"node_id": "x", "headline": "fake"}).encode())
        time.sleep(1.5)  # the watch thread sees the key within its 1 s wait
        assert not coord.failed.is_set() and coord.failure_note() is None, "an unsigned failure is ignored"
        raw.delete(f"{info.store_prefix}/failed")
        decision = coord.decide(RestartPolicy(max_restarts=3), "boom")
        assert decision == Decision("restart", 1, "boom") and restart_count(h.store, h.signer, h.prefix) == 1
        older = raw.try_get("rdzv/budget/policy")  # sealed by the job itself, count 1: kept for a replay
        # Resetting the budget by hand (an unsigned policy state) is not believed: the node
        # goes on from the newest state it has seen, and the next charge is the second.
        state = json.loads(raw.try_get("rdzv/budget/policy") or b"{}")
        state.pop("mac")
        state["failures"] = 0
        raw.set("rdzv/budget/policy", json.dumps(state).encode())
        assert coord.budget.restart_count() == 1
        raw.set(f"{info.store_prefix}/decision", b'{"action": "give_up", "restart_count": 0, "reason": "x"}')
        assert coord.await_decision(1.0) is None, "a forged decision is never read"
        raw.delete(f"{info.store_prefix}/decider")
        assert coord.decide(RestartPolicy(max_restarts=3), "again") == Decision("restart", 2, "again")
        # Writing back the job's own older sealed state (count 1) gives no restart back either.
        assert older is not None
        raw.set("rdzv/budget/policy", older)
        assert coord.budget.restart_count() == 2, "an older sealed budget is a replay: not read"
        raw.delete(f"{info.store_prefix}/decider")
        raw.delete(f"{info.store_prefix}/decision")
        assert coord.decide(RestartPolicy(max_restarts=3), "third") == Decision("restart", 3, "third")
        coord.stop(wait=True)
    finally:
        h.close()
        raw.close()


def test_a_forged_leave_mark_is_not_believed_a_signed_one_is(connect_store: Callable[[], Store]) -> None:
    cfg = fast("leave", 2, 2, token=TOKEN)
    a, b = (RendezvousHandler(connect_store(), cfg, node_id=n) for n in "ab")
    raw = connect_store()
    try:
        infos(join_all([a, b]))
        raw.set("rdzv/leave/hb/b", b"-1")  # a stranger marks b as gone
        assert a._dead(["b"], time.monotonic()) == frozenset(), "b is judged by its counter, not the mark"
        b.close(leaving=True)  # b really leaves: its signed left/ note comes with the mark
        assert a._dead(["b"], time.monotonic()) == frozenset({"b"})
    finally:
        a.close()
        b.close()
        raw.close()


# --- an empty token is refused, never a job without authentication -------------------------------

@pytest.mark.parametrize("argv,environ,names", [
    (["--rdzv-token", ""], {}, "--rdzv-token is empty"),
    (["--rdzv-token", "  "], {}, "--rdzv-token is empty"),
    ([], {"ELASTICTK_RDZV_TOKEN": ""}, "ELASTICTK_RDZV_TOKEN is set but empty"),
    ([], {"ELASTICTK_RDZV_TOKEN": " \t"}, "ELASTICTK_RDZV_TOKEN is blank"),
], ids=["flag", "flag-blank", "env", "env-blank"])
def test_an_empty_token_is_refused_in_one_line_with_exit_2(argv: list[str], environ: dict[str, str],
                                                           names: str) -> None:
    from elastictk.cli.args import main_for_test

    code, err, config = main_for_test([*argv, "--nnodes", "1", "train.py"], environ)
    assert code == 2 and config is None, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and names in lines[0] and "without authentication" in lines[0], err
    assert "Traceback" not in err


def test_a_token_in_the_flag_or_the_environment_is_taken() -> None:
    from elastictk.cli.args import parse_args

    assert parse_args(["--rdzv-token", "t0k", "train.py"], {}, check=False).rdzv_token == "t0k"
    assert parse_args(["train.py"], {"ELASTICTK_RDZV_TOKEN": "t0k"}, check=False).rdzv_token == "t0k"
    assert parse_args(["train.py"], {}, check=False).rdzv_token is None


@pytest.mark.parametrize("token", ["", "   "])
def test_the_python_api_refuses_an_empty_token(token: str) -> None:
    """The library face of --rdzv-token "": an empty secret would sign nothing and refuse
    nobody, so a launcher built on RendezvousConfig gets a ValueError naming it."""
    from elastictk.rendezvous import RendezvousConfig

    with pytest.raises(ValueError, match="token is empty"):
        RendezvousConfig(job_id="j", token=token)
    assert RendezvousConfig(job_id="j", token=None).token is None

"""A running round's watchers tell a member's return from a spare's arrival by the round the
arrival says it ran in (``member_of``, sealed with the token), without reading the round's
member list: at 1,024 nodes every watcher reading it when the whole job re-forms is 1,024 reads
of the round's result, each O(N), while the job waits. On every store backend."""
from __future__ import annotations

from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.rendezvous import MembershipWatch, RendezvousHandler
from elastictk.rendezvous.errors import RendezvousStateError
from elastictk.rendezvous.records import NodeRecord, decode_node
from elastictk.store import Store
from tests.helpers.rdzvjoin import end_joins, join_in_background
from tests.test_rendezvous import connect, fast, infos, join_all, server  # noqa: F401 - fixtures

TOKEN = "member-of-token"


def _round(connect: Callable[[object], Store], job: str) -> tuple[list[RendezvousHandler], MembershipWatch]:  # noqa: F811
    cfg = fast(job, 2, 2, token=TOKEN, heartbeat_timeout=30.0, join_timeout=60.0)
    hs = [RendezvousHandler(connect(), cfg, node_id=n) for n in ("a", "b", "spare")]
    first = infos(join_all(hs[:2]))  # a round of two, running full
    return hs, MembershipWatch(hs[0], first["a"])


def test_a_members_return_wakes_the_watch_without_reading_the_member_list(
        connect: Callable[[object], Store]) -> None:  # noqa: F811
    hs, watch = _round(connect, "back")
    threads = []
    try:
        assert not watch.wait(1.0), watch.reason
        threads.append(join_in_background(hs[1]))  # b leaves the round and comes back for the next
        assert watch.wait(60) and "round 2 opened" in (watch.reason or ""), watch.reason
        assert "_members" not in watch.__dict__, "the watch read the round's member list"
    finally:
        end_joins(hs, threads, watch)


def test_a_spare_in_a_full_round_wakes_nobody(connect: Callable[[object], Store]) -> None:  # noqa: F811
    hs, watch = _round(connect, "spare")
    threads = []
    try:
        threads.append(join_in_background(hs[2]))  # never in a round: its arrival does not say one
        assert not watch.wait(2.0), watch.reason
        assert "_members" in watch.__dict__  # it said nothing: judged by the member list
    finally:
        end_joins(hs, threads, watch)


@pytest.mark.parametrize("value", ["1", True, 0, -3, 1.5, 2**60, [1], {"r": 1}])
def test_a_member_of_that_is_no_round_number_is_refused(value: object) -> None:
    import json

    body = json.loads(NodeRecord("n", {}).to_json())
    raw = json.dumps({**body, "member_of": value}).encode()
    with pytest.raises(RendezvousStateError, match="member_of is not a round number"):
        decode_node("rdzv/j/r/2/a/n", raw)


def test_member_of_round_trips_and_is_absent_when_unknown() -> None:
    assert decode_node("k", NodeRecord("n", {}, 7).to_json()).member_of == 7
    raw = NodeRecord("n", {"x": 1}).to_json()
    assert b"member_of" not in raw and decode_node("k", raw).member_of is None


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
                     max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(value=_JSON | st.integers(min_value=-2**80, max_value=2**80))
def test_any_member_of_is_a_round_number_or_the_one_line_refusal(value: object) -> None:
    """What a stranger (without a token) may put there: nested, huge, wrong types."""
    import json

    body = json.loads(NodeRecord("n", {}).to_json())
    raw = json.dumps({**body, "member_of": value}).encode()
    try:
        got = decode_node("rdzv/j/r/2/a/n", raw).member_of
    except RendezvousStateError as e:
        assert "rdzv/j/r/2/a/n" in str(e) and "\n" not in str(e)  # one line naming the key
    else:
        assert got is None or (type(got) is int and 0 < got < 2**53), got

"""Hostile store values: every reader of bytes others can write (store records, the in-place
store, error files, event logs) is fed nested, huge, truncated, non-UTF-8, NaN/Infinity and
wrongly typed values by a fuzzer. Nothing may raise but the reader's documented one-line
error, and with a job token every such value reads as absent (its MAC is checked over the
raw bytes before any parser sees them)."""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from elastictk._safejson import MAX_DEPTH, MAX_RECORD_BYTES, Unreadable, loads
from elastictk.agent.coordination import POLICY_KEY, Budget, Decision, FailureNote, seal, unseal
from elastictk.agent.exclusion import Exclusion
from elastictk.agent.inplace_host import Setup
from elastictk.agent.stragglers import parse_ranks
from elastictk.inplace.protocol import Generation, Sealer, is_finished
from elastictk.metrics.events import EventLogError, iter_events
from elastictk.rendezvous.auth import Signer
from elastictk.rendezvous.errors import RendezvousStateError
from elastictk.rendezvous.records import decode_node, decode_note, decode_result
from elastictk.rendezvous.sealed import Records
from elastictk.store import FileStore, StoreError
from elastictk.supervisor.errors import ErrorFileUnreadable, read_error_file

TOKEN = "hostile-token"
SIGNER = Signer(TOKEN, "job", "run")
OPEN = Signer(None)
KEY = "failed"

NESTED = [b"[" * 1000, b"[" * 10000, b"{\"a\":" * 10000, b"[{\"a\":" * 5000, b"[" * 65 + b"]" * 65,
          (b"[" * 800) + (b"]" * 800), b"{\"mac\":" * 3000]
HUGE = [b'"' + b"a" * (MAX_RECORD_BYTES + 10) + b'"', b"[" + b"1," * (MAX_RECORD_BYTES // 2) + b"1]",
        b'{"node_id":"' + b"x" * MAX_RECORD_BYTES + b'","headline":"h"}', b"9" * 5000]
CONSTANTS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b'{"restart_count": NaN}',
             b'{"action":"restart","restart_count":1,"reason":"r","delay_s":Infinity}',
             b'{"action":"restart","restart_count":1,"reason":"r","delay_s":1e999}',
             b'{"gen":1e400,"world_size":1,"schema":"elastictk.inplace-generation/1"}',
             b'{"node_id":"\\ud800","headline":"lone surrogate"}']
FIELDS = ["node_id", "headline", "action", "restart_count", "reason", "delay_s", "schema", "gen",
          "world_size", "nodes", "finished", "endpoint", "prefix", "keep", "round", "members", "meta",
          "rank", "mac", "message", "extraInfo", "py_callstack", "timestamp", "kind", "mono", "wall",
          "reason", "cooldown_s", "detail", "by", "ranks", "seq", "host"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20) | st.sampled_from(["restart", "give_up", "elastictk.rdzv/1",
                                              "elastictk.inplace-generation/1", "straggler"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5),
                                                              inner, max_size=6),
    max_leaves=20)


def _legit() -> bytes:
    return Records(_NoStore(), "", SIGNER).seal(KEY, {"node_id": "a", "headline": "boom"})


class _NoStore:
    """Records.seal and Records.open touch no store."""


@st.composite
def hostile(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["nested", "huge", "constant", "typed", "truncated", "bytes", "depth", "mac"]))
    if kind == "nested":
        return draw(st.sampled_from(NESTED))
    if kind == "huge":
        return draw(st.sampled_from(HUGE))
    if kind == "constant":
        return draw(st.sampled_from(CONSTANTS))
    if kind == "typed":
        return json.dumps(draw(json_values)).encode()
    if kind == "truncated":
        legit = _legit()
        return legit[:draw(st.integers(0, len(legit) - 1))]
    if kind == "depth":
        n = draw(st.integers(1, 3000))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        return opener * n + b"1" + closer * n
    if kind == "mac":  # a stranger's record with a MAC that is not this run's
        mac = draw(st.sampled_from(["", "0" * 64, "zz", SIGNER.mac(KEY, {"x": 1})]))
        return json.dumps({"node_id": "m", "headline": "forged", "mac": mac}, sort_keys=True,
                          separators=(",", ":")).encode()
    return draw(st.binary(max_size=200))  # invalid UTF-8 and any other bytes


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.data_too_large])


def no_traceback(fn: Callable[[], Any], *allowed: type[BaseException]) -> Any:
    """``fn()``; an exception other than ``allowed`` fails, and an allowed one is one line."""
    try:
        return fn()
    except allowed as e:
        assert "\n" not in str(e) and str(e), f"{type(e).__name__} is not one line: {str(e)[:300]!r}"
        return e


# --- the parser -------------------------------------------------------------------------------

@FUZZ
@given(raw=hostile())
@example(raw=b"[" * MAX_DEPTH + b"1" + b"]" * MAX_DEPTH)
def test_the_parser_raises_only_unreadable(raw: bytes) -> None:
    got = no_traceback(lambda: loads(raw), Unreadable)
    if not isinstance(got, Unreadable):
        assert len(raw) <= MAX_RECORD_BYTES
        _assert_plain(got)


def _assert_plain(value: Any, depth: int = 1) -> None:
    """Finite numbers, and at most MAX_DEPTH arrays/objects deep (a number inside the deepest
    array is not one more level: hypothesis found 64 arrays around a 1 counted as 65)."""
    if isinstance(value, (dict, list)):
        assert depth <= MAX_DEPTH
    if isinstance(value, float):
        assert math.isfinite(value)
    elif isinstance(value, dict):
        for v in value.values():
            _assert_plain(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _assert_plain(v, depth + 1)


@pytest.mark.parametrize("raw", NESTED + HUGE + CONSTANTS + [b"\xff\xfe{}", b'{"a":1'])
def test_each_named_attack_is_unreadable(raw: bytes) -> None:
    with pytest.raises(Unreadable):
        loads(raw)


def test_a_record_is_at_most_one_mib_whatever_the_constant_says() -> None:
    """An absolute bound, not one built from the constant (the attacks above move with it): a
    string record of 1 MiB + 2 bytes is refused, one of exactly 1 MiB parses."""
    mib = 1024 * 1024
    with pytest.raises(Unreadable, match=f"{mib + 2} bytes, more than the {mib}"):
        loads(b'"' + b"a" * mib + b'"')
    assert len(loads(b'"' + b"a" * (mib - 2) + b'"')) == mib - 2


def test_legit_records_parse() -> None:
    assert loads(b'{"a":[1,2.5,{"b":null}],"c":"\\u00e9"}') == {"a": [1, 2.5, {"b": None}], "c": "é"}
    assert loads(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) is not None


# --- every reader of store values ---------------------------------------------------------------

@FUZZ
@given(raw=hostile())
@example(raw=b"[" * 1000)
def test_sealed_records_read_hostile_bytes_as_absent_with_a_token(raw: bytes) -> None:
    rec = Records(_NoStore(), "rdzv/job/r/1/job", SIGNER)  # type: ignore[arg-type]
    assert no_traceback(lambda: rec.open(KEY, raw)) is None
    assert rec.trusted(KEY, raw) is False
    with pytest.raises(RendezvousStateError):
        unseal(SIGNER, KEY, raw)
    for decode in (decode_note, decode_node, decode_result):
        with pytest.raises(RendezvousStateError):
            decode(KEY, raw, SIGNER)


@FUZZ
@given(raw=hostile())
@example(raw=b"[" * 1000)
def test_without_a_token_hostile_bytes_are_the_one_line_error_or_a_record(raw: bytes) -> None:
    rec = Records(_NoStore(), "rdzv/job/r/1/job", OPEN)  # type: ignore[arg-type]
    got = no_traceback(lambda: rec.open(KEY, raw), RendezvousStateError)
    assert got is None or isinstance(got, (dict, RendezvousStateError))
    if isinstance(got, RendezvousStateError):
        assert "rdzv/job/r/1/job/failed" in str(got)
    assert rec.trusted(KEY, raw) in (True, False)
    no_traceback(lambda: unseal(OPEN, KEY, raw), RendezvousStateError)
    for decode in (decode_note, decode_node, decode_result):
        no_traceback(lambda: decode(KEY, raw, OPEN), RendezvousStateError)
    note = no_traceback(lambda: FailureNote.from_json(raw))
    assert isinstance(note, FailureNote)
    no_traceback(lambda: Decision.from_json(raw), ValueError)
    no_traceback(lambda: Setup.from_json(raw), StoreError)
    no_traceback(lambda: Generation.from_json(raw), ValueError)
    assert no_traceback(lambda: is_finished(raw)) in (True, False)
    if isinstance(got, dict):
        ex = no_traceback(lambda: Exclusion.from_json("a", got))
        assert ex is None or isinstance(ex, Exclusion)
        assert isinstance(no_traceback(lambda: parse_ranks(got.get("ranks"), "h", "n")), list)
        for record in (FailureNote.from_record, Decision.from_record, Setup.from_record):
            no_traceback(lambda: record(got), KeyError, TypeError, ValueError, StoreError)


@FUZZ
@given(value=json_values)
def test_decisions_read_only_sane_values(value: Any) -> None:
    got = no_traceback(lambda: Decision.from_json(json.dumps(value).encode()), ValueError)
    if isinstance(got, Decision):
        assert got.restart_count >= 0 and math.isfinite(got.delay_s) and got.delay_s >= 0


@pytest.fixture(scope="module")
def store() -> Iterator[FileStore]:
    with tempfile.TemporaryDirectory(prefix="elastictk-hostile-") as d:
        s = FileStore(Path(d) / "store", timeout=5)
        yield s
        s.close()


@FUZZ
@given(raw=hostile())
@example(raw=b"[" * 1000)
def test_the_restart_budget_reads_hostile_bytes_as_absent(store: FileStore, raw: bytes) -> None:
    store.set(POLICY_KEY, raw)
    assert no_traceback(lambda: Budget(Records(store, "", SIGNER)).restart_count()) == 0
    no_traceback(lambda: Budget(Records(store, "", OPEN)).restart_count(), RendezvousStateError)


@FUZZ
@given(raw=hostile())
def test_the_inplace_sealer_reads_hostile_bytes_as_absent(raw: bytes) -> None:
    sealer = Sealer("derived-key", "elastictk/inplace/job/r1/a0")
    assert no_traceback(lambda: sealer.open("gen/1", raw)) is None
    assert Sealer(None, "p").open("gen/1", raw) == raw  # no token: believed as is...
    no_traceback(lambda: Generation.from_json(raw), ValueError)  # ...and parsed safely


@FUZZ
@given(raw=hostile())
@example(raw=b'{"message":{"message":"x","extraInfo":{"timestamp":"1e999"}}}')
def test_error_files_are_read_or_named_unreadable(raw: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix="elastictk-hostile-") as d:
        path = Path(d) / "error.json"
        path.write_bytes(raw)
        no_traceback(lambda: read_error_file(str(path)), ErrorFileUnreadable)


@FUZZ
@given(raw=hostile())
def test_event_logs_are_read_or_name_the_line(raw: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix="elastictk-hostile-") as d:
        path = Path(d) / "events.jsonl"
        path.write_bytes(raw.replace(b"\n", b" ") + b"\n")
        no_traceback(lambda: list(iter_events(path)), EventLogError)


# --- the MAC over the raw bytes (a truncated or lengthened MAC is no MAC) -------------------------

def _with_mac(mac: str) -> dict[str, Any]:
    return {"node_id": "a", "headline": "boom", "mac": mac}


def test_every_proper_prefix_and_a_longer_mac_is_refused() -> None:
    body = {"node_id": "a", "headline": "boom"}
    rec = Records(_NoStore(), "", SIGNER)  # type: ignore[arg-type]
    real = SIGNER.mac(KEY, body)
    assert SIGNER.verify(KEY, _with_mac(real)) and rec.open(KEY, rec.seal(KEY, body)) == body
    for bad in [real[:n] for n in range(len(real))] + [real + "0", real + real, real + "x" * 64]:
        assert not SIGNER.verify(KEY, _with_mac(bad)), f"MAC {bad!r} ({len(bad)} digits) verified"
        raw = json.dumps(_with_mac(bad), sort_keys=True, separators=(",", ":")).encode()
        assert rec.open(KEY, raw) is None, f"MAC {bad!r} ({len(bad)} digits) opened"
        with pytest.raises(RendezvousStateError):
            unseal(SIGNER, KEY, raw)


@given(body=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=5))
@settings(max_examples=100, deadline=None)
def test_records_the_job_seals_still_open(body: dict[str, Any]) -> None:
    body.pop("mac", None)
    rec = Records(_NoStore(), "rdzv/j", SIGNER)  # type: ignore[arg-type]
    assert rec.open(KEY, rec.seal(KEY, body)) == body
    assert unseal(SIGNER, "rdzv/j/failed", seal(SIGNER, "rdzv/j/failed", body)) == body

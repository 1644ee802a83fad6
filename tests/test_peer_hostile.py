"""The peer tier's server and wire against hostile input: strangers that connect and stay idle,
trickle bytes, announce huge headers or nest JSON deep; a server out of file descriptors; an
authenticated peer that sends out-of-range fields; and fuzzers for every header reader and
reply parser. Real sockets on 127.0.0.1 against a real :class:`PeerServer`.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.snapshot import messages
from elastictk.snapshot.codec import checksum
from elastictk.snapshot.handshake import greet
from elastictk.snapshot.local import Holder
from elastictk.snapshot.peer import PeerClient, PeerServer
from elastictk.snapshot.peertier import PeerTier
from elastictk.snapshot.replicas import Key, Replicas
from elastictk.snapshot.wire import Late, WireError, parse, recv, send

JOB = "hostile"
TOKEN = b"hostile-token"
ROOT = Path(__file__).resolve().parent.parent


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("elastictk-peer")]


@pytest.fixture
def server() -> Iterator[PeerServer]:
    s = PeerServer("127.0.0.1", Replicas(8 << 20), TOKEN, JOB, handshake_timeout=1.0, max_pending=8)
    try:
        yield s
    finally:
        s.close()
        s.replicas.close()
        assert _threads() == [], "threads left behind"


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server hung up on ``sock`` within ``seconds`` (reading what it sent)."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if sock.recv(4096) == b"":
                return True
        except TimeoutError:
            return False
        except OSError:
            return True
    return False


def _honest_round_trip(port: int) -> float:
    t0 = time.monotonic()
    c = PeerClient("127.0.0.1", port, TOKEN, JOB, timeout=5)
    try:
        part = os.urandom(1000)
        c.put("n1", 0, 2, 1, checksum(part), memoryview(part))
        assert Key("n1", 0, 2, 1) in c.index()
    finally:
        c.close()
    return time.monotonic() - t0


def test_close_waits_for_a_connection_thread_that_is_ending(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection thread past its own cleanup but not yet ended is still joined by close() (it
    once left the set of threads to join in its cleanup, and close() returned while it ran)."""
    serve = PeerServer._serve
    ended = threading.Event()

    def slow_end(self: PeerServer, conn: socket.socket, who: str) -> None:
        serve(self, conn, who)
        ended.set()
        time.sleep(1.0)  # the last lines of a thread on a loaded machine

    monkeypatch.setattr(PeerServer, "_serve", slow_end)
    s = PeerServer("127.0.0.1", Replicas(1 << 20), TOKEN, JOB, handshake_timeout=1.0)
    try:
        socket.create_connection(("127.0.0.1", s.port)).close()  # a stranger that hangs up at once
        assert ended.wait(10)
    finally:
        s.close()
        s.replicas.close()
    assert _threads() == [], "close() returned before a connection thread ended"


# -- strangers before the handshake ------------------------------------------------------------------
def test_idle_and_trickling_strangers_neither_starve_an_honest_peer_nor_pile_up(server: PeerServer) -> None:
    socks: list[socket.socket] = []
    stop = threading.Event()

    def trickle(s: socket.socket) -> None:  # one byte a second: never a whole handshake
        while not stop.wait(1.0):
            try:
                s.send(b"\0")
            except OSError:
                return
    tricklers = []
    try:
        for i in range(40):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            socks.append(s)
            if i % 4 == 0:
                t = threading.Thread(target=trickle, args=(s,), daemon=True)
                t.start()
                tricklers.append(t)
        time.sleep(0.3)  # all accepted
        pending, _ = server.connections()
        assert pending <= server.max_pending, "connections in the handshake are bounded"
        assert len(_threads()) <= server.max_pending + 1, "so are the threads (and their buffers)"
        assert _honest_round_trip(server.port) < 3.0, "an honest peer is served at once"
        # the whole handshake has a deadline: trickling a byte a second does not extend it
        alive = [s for s in socks if not _closed_within(s, 0.01)]
        assert all(_closed_within(s, 2.5) for s in alive), "strangers outlived the handshake deadline"
        assert server.connections() == (0, 0)
    finally:
        stop.set()
        for s in socks:
            s.close()
        for t in tricklers:
            t.join(timeout=5)


def test_a_huge_header_before_the_handshake_is_refused_at_once(server: PeerServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.recv(4096)  # the hello
        s.sendall(struct.pack(">I", 100_000) + b"{" * 1000)  # announces 100 kB: far past a handshake
        assert _closed_within(s, 0.5), "the server waited for the rest of a 100 kB header"
    assert _honest_round_trip(server.port) < 3.0


def test_a_deeply_nested_header_is_one_line_not_a_traceback(server: PeerServer, caplog: pytest.LogCaptureFixture,
                                                            capfd: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.WARNING, "elastictk.snapshot")
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.recv(4096)
            body = b"[" * 1000 + b"]" * 1000
            s.sendall(struct.pack(">I", len(body)) + body)
            assert _closed_within(s, 2)
    time.sleep(0.2)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "RecursionError" not in err
    lines = [r.getMessage() for r in caplog.records if "127.0.0.1" in r.getMessage()]
    assert len(lines) == 1, lines  # five bad connections, one line (rate-limited)
    assert "\n" not in lines[0]
    assert _honest_round_trip(server.port) < 3.0


def test_authenticated_connections_past_the_cap_are_closed_at_once() -> None:
    s = PeerServer("127.0.0.1", Replicas(1 << 20), TOKEN, JOB, max_peers=2)
    clients = []
    try:
        clients = [PeerClient("127.0.0.1", s.port, TOKEN, JOB, timeout=30) for _ in range(3)]
        # The server's threads finish their side of the handshakes in any order (a loaded host
        # ran the third's first and closed the second): any one of the three is past the cap.
        served = []
        for c in clients:
            try:
                served.append(c.index() == [])
            except Late:
                raise  # closed at once, not left to the client's deadline
            except (WireError, OSError):
                served.append(False)
        assert sorted(served) == [False, True, True], served
        assert s.connections() == (0, 2)
    finally:
        for c in clients:
            c.close()
        s.close()


# -- out of file descriptors --------------------------------------------------------------------------
CHILD = r"""
import logging, os, resource, sys
from elastictk.snapshot.peer import PeerServer
from elastictk.snapshot.replicas import Replicas
logging.basicConfig(level=logging.WARNING, format="%(message)s")
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
srv = PeerServer("127.0.0.1", Replicas(1 << 20), b"t", "j")
print(srv.port, flush=True)
sys.stdin.readline()
filler = []
try:
    while True:
        filler.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
print("exhausted", flush=True)
sys.stdin.readline()
for fd in filler:
    os.close(fd)
print("released", flush=True)
sys.stdin.readline()
srv.close()
"""


def test_the_server_accepts_again_after_running_out_of_file_descriptors() -> None:
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT)
    waiting = None
    try:
        assert p.stdin is not None and p.stdout is not None
        port = int(p.stdout.readline())
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "exhausted"
        waiting = socket.create_connection(("127.0.0.1", port), timeout=5)  # queued: accept fails now
        time.sleep(0.5)  # several failed accepts
        p.stdin.write("release\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "released"
        waiting.settimeout(5)
        assert b"elastictk-peer/1" in waiting.recv(4096), "the queued connection was accepted"
        c = PeerClient("127.0.0.1", port, b"t", "j", timeout=5)
        assert c.index() == []
        c.close()
        p.stdin.write("stop\n")
        p.stdin.flush()
        _, err = p.communicate(timeout=30)
    finally:
        if waiting is not None:
            waiting.close()
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err
    lines = [ln for ln in err.splitlines() if "file descriptors" in ln]
    assert len(lines) == 1, err  # said once, not once per failed accept
    assert "Traceback" not in err


# -- an authenticated peer sending bad fields ----------------------------------------------------------
def _raw_client(port: int) -> socket.socket:
    """An authenticated connection (the handshake done) for sending hand-made headers."""
    c = PeerClient("127.0.0.1", port, TOKEN, JOB, timeout=5)
    return c.sock


@pytest.mark.parametrize("header, field", [
    ({"op": "put", "origin": "n", "rank": 0, "world": 2, "step": 1, "nbytes": -(1 << 30), "sum": 1}, "nbytes"),
    ({"op": "put", "origin": "n", "rank": 0, "world": 2, "step": 1, "nbytes": 10, "sum": -1}, "sum"),
    ({"op": "put", "origin": "n", "rank": 5, "world": 2, "step": 1, "nbytes": 10, "sum": 1}, "rank"),
    ({"op": "put", "origin": ["n"], "rank": 0, "world": 2, "step": 1, "nbytes": 10, "sum": 1}, "origin"),
    ({"op": "get", "rank": True, "world": 2, "step": 1}, "rank"),
    ({"op": "get", "rank": 0, "world": 2, "step": 1.5}, "step"),
    ({"op": 7}, "op"),
])
def test_an_out_of_range_field_is_refused_in_one_line(server: PeerServer, header: dict[str, Any], field: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "elastictk.snapshot")
    sock = _raw_client(server.port)
    try:
        send(sock, header)
        reply = recv(sock)
        assert reply["ok"] is False and f"field {field!r}" in reply["why"], reply
        assert server.replicas.used() == 0
    finally:
        sock.close()
    time.sleep(0.1)
    assert any(f"field {field!r}" in r.getMessage() for r in caplog.records)
    assert _honest_round_trip(server.port) < 3.0


@pytest.mark.parametrize("raw", [b'{"op":"get","rank":Infinity,"world":2,"step":1}',
                                 b'{"op":"get","rank":NaN,"world":2,"step":1}',
                                 b'{"op":"get","rank":1e999,"world":2,"step":1}',
                                 b'{"op":"get","rank":' + b"9" * 5000 + b',"world":2,"step":1}'])
def test_infinity_nan_and_huge_numbers_end_that_connection_only(server: PeerServer, raw: bytes,
                                                                capfd: pytest.CaptureFixture[str],
                                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "elastictk.snapshot")
    sock = _raw_client(server.port)
    try:
        sock.sendall(struct.pack(">I", len(raw)) + raw)
        assert _closed_within(sock, 2)
    finally:
        sock.close()
    time.sleep(0.1)
    assert "Traceback" not in capfd.readouterr().err
    lines = [r.getMessage() for r in caplog.records if "from 127.0.0.1" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines  # refused, in one line
    assert _honest_round_trip(server.port) < 3.0


# -- a hostile (authenticated) server -----------------------------------------------------------------
class Liar:
    """A server that knows the token and answers every request with ``reply``."""

    def __init__(self, reply: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    greet(conn, TOKEN, JOB, time.monotonic() + 5)
                    while True:
                        send(conn, self.reply(recv(conn)))
                except (OSError, WireError, ValueError):
                    pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        self.sock.close()
        self.thread.join(timeout=10)


@pytest.mark.parametrize("reply", [{"ok": True, "replicas": "not a list"},
                                   {"ok": True, "replicas": [{"origin": "x", "rank": 1e308, "world": 2, "step": 1}]},
                                   {"ok": True, "replicas": [7]},
                                   {"ok": "yes"}])
def test_a_malformed_index_reply_is_a_refusal_not_an_error_in_the_round(reply: dict[str, Any],
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "elastictk.snapshot")
    liar = Liar(lambda req: reply)
    holder = Holder(1, 1 << 20)
    tier = PeerTier(holder, "127.0.0.1", TOKEN.decode(), JOB, 1, 1 << 20)
    try:
        c = PeerClient("127.0.0.1", liar.port, TOKEN, JOB, timeout=5)
        with pytest.raises(messages.BadMessage):
            c.index()
        c.close()
        members = [_Member("me", 0, {"addr": "127.0.0.1", **tier.meta()}),
                   _Member("liar", 1, {"addr": "127.0.0.1", "snapshot_peer": liar.port})]
        tier.round(members, 2, "me", 0, prefetch=True)  # no exception escapes the round's start
        assert any("cannot ask 127.0.0.1" in r.getMessage() for r in caplog.records)
    finally:
        tier.close()
        holder.close()
        liar.close()


def test_a_get_reply_announcing_more_than_the_slot_holds_allocates_nothing() -> None:
    liar = Liar(lambda req: {"ok": True, "nbytes": 1 << 40, "sum": 0, "origin": "x"})
    try:
        c = PeerClient("127.0.0.1", liar.port, TOKEN, JOB, timeout=5)
        with pytest.raises(messages.BadMessage, match="field 'nbytes' is 1099511627776, outside 0..4096"):
            c.get(0, 2, 1, limit=4096)
        c.close()
    finally:
        liar.close()


class _Member:
    def __init__(self, node_id: str, rank: int, meta: dict[str, Any]) -> None:
        self.node_id, self.rank, self.meta = node_id, rank, meta


@pytest.mark.parametrize("meta", [{"addr": "127.0.0.1", "snapshot_peer": 70000},
                                  {"addr": "127.0.0.1", "snapshot_peer": True},
                                  {"addr": ["127.0.0.1"], "snapshot_peer": 1234},
                                  {"addr": "127.0.0.1", "snapshot_peer": float("inf")}])
def test_a_malformed_endpoint_in_a_join_record_is_skipped(meta: dict[str, Any]) -> None:
    assert messages.endpoint(meta, "snapshot_peer") is None


# -- fuzzers ------------------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
fields = st.sampled_from(["op", "origin", "rank", "world", "step", "nbytes", "sum", "ok", "why", "replicas",
                          "hello", "auth", "nonce", "mac"])
hostile_ints = st.sampled_from([-1, -(1 << 40), 0, 1, 1 << 63, 1 << 64, 1 << 100, True, False])
headers = st.dictionaries(fields, json_values | hostile_ints | st.just(float("nan")) | st.just(float("inf")),
                          max_size=10)
PARSERS: list[Callable[[dict[str, Any]], Any]] = [
    messages.answer, messages.index_reply, lambda h: messages.get_reply(h, 1 << 20), messages.op,
    messages.put_request, messages.get_request, messages.hello, messages.client_nonce, messages.optional_mac,
    messages.key, lambda h: messages.endpoint(h, "snapshot_peer"),
]


@settings(max_examples=300, deadline=None)
@given(headers)
def test_every_reply_and_request_parser_returns_valid_values_or_refuses(h: dict[str, Any]) -> None:
    for parse_ in PARSERS:
        try:
            out = parse_(h)
        except messages.BadMessage as e:
            assert "\n" not in str(e) and len(str(e)) < 300
            continue
        if isinstance(out, messages.Put):
            assert type(out.nbytes) is int and 0 <= out.nbytes <= messages.MAX_PART
            assert type(out.digest) is int and 0 <= out.digest <= messages.MAX_SUM
            out = out.key
        if isinstance(out, messages.Part):
            assert type(out.nbytes) is int and type(out.digest) is int and 0 <= out.nbytes <= 1 << 20
        if isinstance(out, Key):
            out = [out]
        if isinstance(out, list):
            assert all(isinstance(k, Key) and isinstance(k.origin, str) and type(k.step) is int and k.step >= 0
                       and type(k.rank) is int and type(k.world) is int and 0 <= k.rank < k.world for k in out)
        if isinstance(out, tuple) and parse_ is messages.get_request:
            assert all(type(v) is int for v in out) and 0 <= out[0] < out[1]


VALID = [{"op": "put", "origin": "n1", "rank": 1, "world": 4, "step": 7, "nbytes": 100, "sum": 5},
         {"op": "get", "rank": 1, "world": 4, "step": 7},
         {"ok": True, "nbytes": 100, "sum": 5, "origin": "n1"}]
hostile_values = (hostile_ints | st.floats() | st.text(max_size=5) | st.none()
                  | st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(VALID), st.data())
def test_one_hostile_field_in_an_otherwise_valid_message_is_refused(base: dict[str, Any], data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(base)))
    test_every_reply_and_request_parser_returns_valid_values_or_refuses.hypothesis.inner_test(  # type: ignore[attr-defined]
        {**base, name: data.draw(hostile_values)})


@settings(max_examples=100, deadline=None)
@given(st.lists(st.fixed_dictionaries({"origin": json_values, "rank": json_values | hostile_ints,
                                       "world": json_values | hostile_ints, "step": json_values | hostile_ints}),
                max_size=5))
def test_the_index_parser_accepts_only_whole_valid_entries(entries: list[dict[str, Any]]) -> None:
    try:
        keys = messages.index_reply({"ok": True, "replicas": entries})
    except messages.BadMessage:
        return
    for k, e in zip(keys, entries, strict=True):
        assert type(e["rank"]) is int and type(e["world"]) is int and type(e["step"]) is int
        assert 0 <= k.rank < k.world <= messages.MAX_WORLD and k.step >= 0 and isinstance(k.origin, str)


def _frame_bytes() -> st.SearchStrategy[bytes]:
    jsonish = headers.map(lambda h: json.dumps(h).encode())  # NaN/Infinity included as json writes them
    nested = st.integers(1, 100_000).map(lambda n: b"[" * n + b"]" * n)
    objs = st.integers(1, 50_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n)
    return st.one_of(st.binary(max_size=200), jsonish, nested, objs,
                     st.binary(min_size=1, max_size=50).map(lambda b: b"\xff\xfe" + b))


@settings(max_examples=300, deadline=None)
@given(_frame_bytes(), st.sampled_from(["whole", "truncated", "huge"]))
def test_the_header_reader_returns_an_object_or_a_wire_error(body: bytes, how: str) -> None:
    if how == "whole":
        data = struct.pack(">I", len(body)) + body
    elif how == "truncated":
        data = (struct.pack(">I", len(body) + 1) + body)[:max(1, len(body) // 2)]
    else:
        data = struct.pack(">I", 0xFFFFFFFF) + body[:100]
    a, b = socket.socketpair()

    def write() -> None:  # from a thread: a frame may be larger than the socket buffer
        try:
            a.sendall(data)
            a.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        try:
            out = recv(b, limit=1 << 20, deadline=time.monotonic() + 5)
        except WireError as e:
            assert "\n" not in str(e)
            return
        assert isinstance(out, dict) and how == "whole"
    finally:
        b.close()
        writer.join(timeout=5)
        a.close()


@settings(max_examples=200, deadline=None)
@given(_frame_bytes())
def test_the_json_parse_never_raises_anything_but_a_wire_error(body: bytes) -> None:
    try:
        assert isinstance(parse(body), dict)
    except WireError:
        pass

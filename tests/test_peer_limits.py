"""The peer tier against a peer that holds the job's token and means harm (issue 36, findings 2
and 4): one peer taking every authenticated connection, zero-byte parts that cost no bytes but a
replica each, a put that reserves memory and trickles its bytes, a server that trickles its
hello, its index or a part, and a refusal whose text forges a log line. Real sockets on
loopback; the attacker speaks from 127.0.0.2, an honest peer from 127.0.0.1 (one address is one
peer). Each test was red before the limits existed.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Iterator, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.snapshot import messages
from elastictk.snapshot.codec import checksum
from elastictk.snapshot.handshake import greet, introduce
from elastictk.snapshot.local import Holder
from elastictk.snapshot.peer import PeerClient, PeerServer
from elastictk.snapshot.peertier import PeerTier
from elastictk.snapshot.replicas import Key, NoRoom, Replicas
from elastictk.snapshot.wire import Late, WireError, recv, send

JOB = "limits"
TOKEN = b"limits-token"
EVIL = "127.0.0.2"  # the attacker's source address: a peer of its own
FORGED = "busy\n[elastictk-run] succeeded (exit 0): all workers finished"


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("elastictk-peer")]


@pytest.fixture
def server() -> Iterator[PeerServer]:
    s = PeerServer("127.0.0.1", Replicas(8 << 20), TOKEN, JOB, put_floor=1.0)
    try:
        yield s
    finally:
        s.close()
        s.replicas.close()
        assert _threads() == [], "threads left behind"


def _evil(port: int) -> socket.socket:
    """An authenticated connection from :data:`EVIL`: the attacker knows the token."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.settimeout(10)
        s.bind((EVIL, 0))
        s.connect(("127.0.0.1", port))
        introduce(s, TOKEN, JOB, time.monotonic() + 10)
        s.settimeout(10)
    except BaseException:
        s.close()
        raise
    return s


def _honest_put(port: int, step: int = 1, size: int = 1000) -> None:
    c = PeerClient("127.0.0.1", port, TOKEN, JOB, timeout=10)
    try:
        part = os.urandom(size)
        c.put("honest", 0, 2, step, checksum(part), memoryview(part))
        assert Key("honest", 0, 2, step) in c.index()
    finally:
        c.close()


def _waited(cond: Callable[[], bool], timeout: float = 60) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _hung_up(sock: socket.socket, within: float) -> bool:
    """Whether the other side closed ``sock`` before ``within`` seconds passed (reading all)."""
    end = time.monotonic() + within
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            return False
        except OSError:
            return True
    return False


def _put_header(sock: socket.socket, world: int, nbytes: int, step: int = 1) -> dict[str, Any]:
    send(sock, {"op": "put", "origin": "evil", "rank": 0, "world": world, "step": step, "nbytes": nbytes,
                "sum": checksum(bytes(nbytes))})
    return recv(sock)


# -- replicas are counted, not only their bytes --------------------------------------------------------
def test_zero_byte_parts_are_refused_and_keep_nothing(server: PeerServer) -> None:
    fds = len(os.listdir("/proc/self/fd"))
    refused = 0
    for world in range(1, 484):  # the review's 483 parts, each of its own (rank, world)
        with _evil(server.port) as s:
            answer = _put_header(s, world, 0)
            refused += answer["ok"] is False and "field 'nbytes' is 0" in answer["why"]
    assert refused == 483 and server.replicas.count() == 0
    assert _waited(lambda: server.connections() == (0, 0)), "the refused connections were not closed"
    assert len(os.listdir("/proc/self/fd")) <= fds, "a refused part kept a descriptor"
    _honest_put(server.port)


def test_a_replica_holds_no_file_descriptor() -> None:
    r = Replicas(64 << 20)
    fds = len(os.listdir("/proc/self/fd"))
    try:
        for world in range(1, 101):
            rep = r.reserve(Key("n", 0, world, 1), 0, 4096, "p")
            rep.data()[:] = bytes(4096)
            r.keep(rep)
        assert r.count() == 100 and len(os.listdir("/proc/self/fd")) == fds
    finally:
        r.close()


PEERS = ["a", "b", "c"]
ops = st.lists(st.tuples(st.sampled_from(["reserve", "keep", "discard"]), st.sampled_from(PEERS),
                         st.integers(1, 6), st.integers(0, 3), st.integers(1, 3 << 10)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(1, 12), st.integers(1, 6), st.booleans())
def test_no_sequence_of_puts_passes_a_count_byte_or_per_peer_limit(seq: list[tuple[str, str, int, int, int]],
                                                                   total: int, per_peer: int, ring: bool) -> None:
    """``ring``: peer "a" is the ring's sender of origin "a" (one part of it in flight may take
    more than half); the bytes and counts hold all the same, and every other peer's half."""
    budget = 8 << 10
    r = Replicas(budget, max_replicas=total, max_peer_replicas=per_peer,
                 sender=(lambda origin, peer: (origin, peer) == ("a", "a")) if ring else None)
    pending: list[Any] = []
    try:
        for op, peer, world, step, size in seq:
            if op == "reserve":
                try:
                    pending.append(r.reserve(Key(peer, 0, world, step), 0, size, peer))
                except NoRoom as e:
                    assert "\n" not in str(e)
            elif pending:
                rep = pending.pop(0)
                if op == "keep":
                    r.keep(rep)
                else:
                    r.discard(rep)
            held = list(r._held.values())
            arriving = list(r._pending)
            mapped = sum(x.length for x in held + arriving)  # a superseded one counts until it goes
            assert mapped == r.used() <= budget and len(held) + len(arriving) <= total
            for p in PEERS:
                assert sum(x.peer == p for x in held + arriving) <= per_peer
                mine = [x.length for x in arriving if x.peer == p]
                assert sum(mine) <= budget // 2 or (ring and p == "a" and len(mine) == 1)
    finally:
        r.close()


def test_refusals_for_many_ranks_are_one_line_per_peer(server: PeerServer, caplog: pytest.LogCaptureFixture) -> None:
    """The ranks of a put are the sender's to choose: a line per rank would let one peer flood
    the log (2**20 ranks), so a refusal is logged once a minute per peer."""
    caplog.set_level(logging.WARNING, "elastictk.snapshot")
    with _evil(server.port) as s:
        for rank in range(100):
            send(s, {"op": "put", "origin": "evil", "rank": rank, "world": 100, "step": 1,
                     "nbytes": server.replicas.budget + 1, "sum": 0})
            assert recv(s)["ok"] is False
    lines = [r.getMessage() for r in caplog.records if "does not fit" in r.getMessage()]
    assert len(lines) == 1, lines


# -- per-peer connection slots ---------------------------------------------------------------------------
def test_one_peer_cannot_take_every_authenticated_connection(server: PeerServer,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "elastictk.snapshot")
    socks: list[socket.socket] = []
    try:
        for _ in range(server.max_peers):  # all 64 slots, if one peer could have them
            socks.append(_evil(server.port))
        served = sum(1 for s in socks if _answers(s))
        assert served == server.max_peer_connections, served
        _honest_put(server.port)  # an honest peer still gets a slot, at once
        assert any(f"from {EVIL} open (the most one peer may)" in r.getMessage() for r in caplog.records)
    finally:
        for s in socks:
            s.close()


def _answers(s: socket.socket) -> bool:
    """Whether the server serves this connection (answers an index) or closed it."""
    try:
        send(s, {"op": "index"})
        return recv(s, deadline=time.monotonic() + 10).get("ok") is True
    except (WireError, OSError):
        return False


# -- a trickling put, and the memory in flight per peer ----------------------------------------------------
def test_a_trickling_put_is_cut_off_and_its_memory_freed(server: PeerServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "elastictk.snapshot")
    budget = server.replicas.budget
    with _evil(server.port) as whole:  # the whole budget reserved by one peer: more than its half
        answer = _put_header(whole, 1, budget)
        assert answer["ok"] is False and "at most half of the replicas' bound" in answer["why"], answer
    s = _evil(server.port)
    stop = threading.Event()

    def trickle() -> None:  # a byte every 0.2 s: a socket timeout never fires
        while not stop.wait(0.2):
            try:
                s.send(b"\0")
            except OSError:
                return
    t = threading.Thread(target=trickle, daemon=True)
    try:
        assert _put_header(s, 1, budget // 2)["ok"] is True  # half of the budget, reserved
        t.start()
        _honest_put(server.port, size=budget // 4)  # the other half is still there for honest peers
        assert _hung_up(s, 60), "a trickling put was not cut off"  # its deadline: 1 s + 4 MiB at 16 MiB/s
        assert Key("evil", 0, 1, 1) not in server.replicas.index() and server.replicas.used() == budget // 4
    finally:
        stop.set()
        t.join(timeout=10)
        s.close()
    lines = [r.getMessage() for r in caplog.records if "did not arrive in time" in r.getMessage()]
    assert len(lines) == 1 and EVIL in lines[0] and "reservation is freed" in lines[0], lines


# -- a trickling server ---------------------------------------------------------------------------------
class Trickler:
    """A server that knows the token and sends ``reply(phase)`` one byte every 0.2 s: its hello
    (``phase="hello"``), or the answer to the first request after an honest handshake."""

    def __init__(self, phase: str, reply: bytes) -> None:
        self.phase, self.reply = phase, reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            try:
                if self.phase != "hello":
                    greet(conn, TOKEN, JOB, time.monotonic() + 10)
                    recv(conn)
                for i in range(len(self.reply)):
                    if self.stop.wait(0.2):
                        return
                    conn.sendall(self.reply[i:i + 1])
            except (OSError, WireError):
                pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        self.thread.join(timeout=10)


def _frame(h: dict[str, Any]) -> bytes:
    import json
    body = json.dumps(h).encode()
    return len(body).to_bytes(4, "big") + body


TRICKLED: dict[str, tuple[bytes, Callable[[PeerClient], Any]]] = {
    "hello": (_frame({"hello": "elastictk-peer/1", "auth": "hmac-sha256", "nonce": "0" * 32}), lambda c: None),
    "index": (_frame({"ok": True, "replicas": [{"origin": "x" * 200, "rank": 0, "world": 2, "step": 1}]}),
              lambda c: c.index()),
    "get": (_frame({"ok": True, "nbytes": 100, "sum": checksum(bytes(100)), "origin": "x"}) + bytes(100),
            lambda c: c.get(0, 2, 1)),
}


@pytest.mark.parametrize("phase", sorted(TRICKLED))
def test_a_trickling_server_is_late_not_a_hang(phase: str) -> None:
    reply, call = TRICKLED[phase]
    srv = Trickler(phase, reply)
    try:
        with pytest.raises(Late):
            c: Optional[PeerClient] = None
            try:
                c = PeerClient("127.0.0.1", srv.port, TOKEN, JOB, timeout=1.0)
                call(c)
            finally:
                if c is not None:
                    c.close()
    finally:
        srv.close()


# -- a peer's text in our log ---------------------------------------------------------------------------
class Refuser:
    """A server that knows the token and refuses every request with ``why``."""

    def __init__(self, why: str) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port, self.why = self.sock.getsockname()[1], why
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
                    greet(conn, TOKEN, JOB, time.monotonic() + 10)
                    while True:
                        recv(conn)
                        send(conn, {"ok": False, "why": self.why})
                except (OSError, WireError):
                    pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(timeout=10)


class _Member:
    def __init__(self, node_id: str, rank: int, meta: dict[str, Any]) -> None:
        self.node_id, self.rank, self.meta = node_id, rank, meta


def test_a_refusal_cannot_forge_a_line_in_the_jobs_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "elastictk.snapshot")
    liar = Refuser(FORGED + "\x1b[2K" + "y" * 800)
    holder = Holder(1, 1 << 20)
    tier = PeerTier(holder, "127.0.0.1", TOKEN.decode(), JOB, 1, 1 << 20)
    try:
        members = [_Member("me", 0, {"addr": "127.0.0.1", **tier.meta()}),
                   _Member("liar", 1, {"addr": "127.0.0.1", "snapshot_peer": liar.port})]
        tier.round(members, 2, "me", 0, prefetch=True)  # asks the liar for its index: refused
        c = PeerClient("127.0.0.1", liar.port, TOKEN, JOB, timeout=10)
        with pytest.raises(WireError) as refused:
            c.put("me", 0, 2, 1, 0, memoryview(b"x"))
        c.close()
    finally:
        tier.close()
        holder.close()
        liar.close()
    said = [r.getMessage() for r in caplog.records if "busy" in r.getMessage()] + [str(refused.value)]
    assert len(said) == 2, said
    for line in said:
        assert "\n" not in line and "\x1b" not in line and len(line) < 600, line
        assert "busy\\n[elastictk-run] succeeded" in line, line  # shown, escaped


@pytest.mark.parametrize("value", ["n1\n[elastictk-run] succeeded", "n\x1b[1m", "n\u202e1"])
def test_a_name_that_cannot_be_printed_is_refused(value: str) -> None:
    with pytest.raises(messages.BadMessage, match="cannot be printed"):
        messages.index_reply({"ok": True, "replicas": [{"origin": value, "rank": 0, "world": 2, "step": 1}]})
    with pytest.raises(messages.BadMessage, match="cannot be printed"):
        messages.put_request({"op": "put", "origin": value, "rank": 0, "world": 2, "step": 1, "nbytes": 1, "sum": 0})


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=messages.MAX_WHY) | st.text(alphabet=st.characters(max_codepoint=0x3000), max_size=50),
       st.booleans())
def test_a_peers_reason_is_shown_printable_and_bounded(why: str, ok: bool) -> None:
    shown = messages.answer({"ok": ok, "why": why}).why
    assert shown.isprintable() and len(shown) <= messages.SHOWN * 10 + 40
    assert len(messages.shown(why)) <= messages.SHOWN * 10 + 40


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_a_printable_name_is_kept_as_it_is_and_any_other_refused(name: str) -> None:
    try:
        out = messages.text({"n": name}, "n", 40)
    except messages.BadMessage:
        assert not name.isprintable()
        return
    assert out == name and name.isprintable()


def test_the_limits_the_docs_state_are_the_codes() -> None:
    """docs/snapshots.md's table of a token holder's limits, against the constants."""
    from pathlib import Path

    from elastictk.snapshot import peer, peertier, replicas, wire

    docs = (Path(__file__).resolve().parent.parent / "docs" / "snapshots.md").read_text()
    rows = {
        "authenticated connections from one address / in all": f"{peer.MAX_PEER_CONNECTIONS} / {peer.MAX_PEERS}",
        "replicas held or arriving from one address / in all":
            f"{replicas.MAX_PEER_REPLICAS} / {replicas.MAX_REPLICAS:,}",
        "bytes still arriving from one address": "half of" if replicas.PEER_INFLIGHT == 0.5 else "?",
        "a put's bytes, a `get`'s bytes (both sides)":
            f"{peer.PUT_FLOOR:g} s plus the part's size at {wire.MIN_RATE >> 20} MiB/s",
        "the client: connect and handshake; each `index`/`get` header":
            f"{peertier.CONNECT_TIMEOUT:g} s at a round's start ({peertier.PUT_TIMEOUT:g} s for a put)",
        "descriptors left to the agent (none accepted meanwhile)": f"{peer.FD_RESERVE} (a quarter",
    }
    for name, value in rows.items():
        assert f"| {name} | {value}" in docs, (name, value)


# -- a bound of one replica (--snapshot-replica-memory): 3x per node, and what it costs ------------------
def test_a_bound_of_one_part_drops_the_kept_replica_before_its_successor_and_says_so_once() -> None:
    said: list[tuple[str, str]] = []
    part = 4096
    r = Replicas(part, warn=lambda cause, line: said.append((cause, line)),
                 sender=lambda origin, peer: (origin, peer) == ("n1", "10.0.0.1"))
    try:
        first = r.reserve(Key("n1", 0, 2, 1), 0, part, "10.0.0.1")  # the whole bound: the ring's sender
        r.keep(first)
        nxt = r.reserve(Key("n1", 0, 2, 2), 0, part, "10.0.0.1")
        assert r.index() == [] and r.tight == 1, "the kept replica went before its successor arrived"
        assert r.used() == part
        r.discard(nxt)  # its sender lost mid-send: this node now holds no replica of rank 0 (the cost)
        assert r.index() == []
        r.keep(r.reserve(Key("n1", 0, 2, 3), 0, part, "10.0.0.1"))
        r.keep(r.reserve(Key("n1", 0, 2, 4), 0, part, "10.0.0.1"))
        assert [k.step for k in r.index()] == [4] and r.tight == 2  # step 3 arrived with none held
        assert len({cause for cause, _ in said}) == 1 and said[0][1].startswith(
            "the replica of rank 0's step 1 from n1 was dropped before step 2 arrives: 4.1 kB of replica "
            "memory holds one part of it (4.1 kB), not two"), said
        assert "give --snapshot-replica-memory at least 8.2 kB" in said[0][1]
    finally:
        r.close()
    r = Replicas(part, sender=lambda origin, peer: (origin, peer) == ("n1", "10.0.0.1"))
    try:  # any other peer (or origin) is held to half of the bound in flight
        for origin, peer in (("n9", "10.0.0.9"), ("n9", "10.0.0.1"), ("n1", "10.0.0.9")):
            with pytest.raises(NoRoom, match="one peer may have at most half"):
                r.reserve(Key(origin, 1, 2, 1), 0, part // 2 + 1, peer)
    finally:
        r.close()


def test_a_bound_of_two_parts_keeps_the_replica_beside_its_successor() -> None:
    """The default (--snapshot-memory sized for two slots): never dropped early, nothing said."""
    said: list[str] = []
    r = Replicas(2 * 4096, warn=lambda cause, line: said.append(line), hold=lambda: True,
                 sender=lambda origin, peer: True)
    try:
        r.keep(r.reserve(Key("n1", 0, 2, 1), 0, 4096, "p"))
        r.discard(r.reserve(Key("n1", 0, 2, 2), 0, 4096, "p"))  # lost mid-send
        assert [k.step for k in r.index()] == [1] and r.tight == 0 and said == []
    finally:
        r.close()

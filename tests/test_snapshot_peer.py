"""The peer snapshot tier: ring assignment, replica retention, the authenticated transport, two
agents' tiers shipping and fetching parts, and (on test hosts) a whole host killed whose ranks
restore on a spare from a neighbour's replica.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastictk.snapshot.codec import checksum
from elastictk.snapshot.local import Holder, Region
from elastictk.snapshot.peer import PeerClient, PeerServer
from elastictk.snapshot.peertier import ENV_THROTTLE, PeerTier
from elastictk.snapshot.replicas import KEEP, Key, Replicas, stale, superseded
from elastictk.snapshot.ring import ring_targets, to_fetch
from elastictk.snapshot.settings import ENV_NOTIFY, SettingsError, parse_replicas, parse_tiers
from elastictk.snapshot.wire import Refused, WireError

JOB = "peer-test"
TOKEN = "s3cret-token"


# -- pure parts -------------------------------------------------------------------------------------
@given(st.integers(1, 40), st.integers(0, 6), st.data())
def test_ring_targets_are_the_next_nodes_and_every_node_is_held_equally(count: int, replicas: int,
                                                                         data: st.DataObject) -> None:
    pos = data.draw(st.integers(0, count - 1))
    targets = ring_targets(pos, count, replicas)
    n = min(replicas, count - 1)
    assert len(targets) == len(set(targets)) == n and pos not in targets
    assert targets == [(pos + k) % count for k in range(1, n + 1)]
    held = [sum(p in ring_targets(q, count, replicas) for q in range(count)) for p in range(count)]
    assert held == [n] * count  # each node holds exactly n others' parts
    # losing any n consecutive-or-not nodes leaves a holder for every lost node's parts
    lost = set(data.draw(st.lists(st.integers(0, count - 1), max_size=n, unique=True)))
    for p in lost:
        assert not targets or any(t not in lost for t in ring_targets(p, count, replicas))


@given(st.sets(st.integers(0, 30), max_size=4),
       st.dictionaries(st.integers(0, 30), st.lists(st.sampled_from("abc"), min_size=1, max_size=2), max_size=5))
def test_to_fetch_gets_the_newest_two_steps_not_held_here(local: set[int], offers: dict[int, list[str]]) -> None:
    got = to_fetch(local, offers)
    newest = sorted(local | set(offers), reverse=True)[:2]
    assert [s for s, _ in got] == sorted(s for s in newest if s not in local)
    assert all(holder == offers[s][0] for s, holder in got)


keys = st.builds(Key, st.sampled_from(["n0", "n1", "n2"]), st.integers(0, 3), st.sampled_from([4, 6]),
                 st.integers(0, 9))


@given(st.sets(keys, max_size=12), keys)
def test_keeping_a_replica_keeps_the_newest_of_its_rank_from_its_sender_only(held: set[Key], new: Key) -> None:
    after = (held - superseded(held, new)) | {new}
    same = [k for k in after if (k.rank, k.world) == (new.rank, new.world)]
    assert {k.origin for k in same} == {new.origin}, "a rank's parts come from its current owner"
    assert len(same) <= KEEP and new in same
    others = {k for k in held if (k.rank, k.world) != (new.rank, new.world)}
    assert others <= after, "other ranks' replicas are untouched"


@given(st.sets(keys, max_size=12), st.sets(st.sampled_from(["n0", "n1", "n2"])),
       st.sets(st.sampled_from(["n0", "n1", "n2"])), st.sampled_from([4, 6]))
def test_a_round_drops_other_worlds_and_nodes_gone_for_a_whole_round(held: set[Key], members: set[str],
                                                                       previous: set[str], world: int) -> None:
    gone = stale(held, members, previous, world)
    for k in held:
        useful = k.world == world and (k.origin in members or k.origin in previous)
        assert (k in gone) != useful


def test_tier_flags_peer_implies_local_and_bad_values_are_one_line() -> None:
    assert parse_tiers("peer", "--snapshot") == ("local", "peer")
    assert parse_tiers("disk,peer", "--snapshot") == ("local", "peer", "disk")
    with pytest.raises(SettingsError, match=r"^--snapshot: unknown tier 'remote'; use local, peer, disk"):
        parse_tiers("remote", "--snapshot")
    assert parse_replicas("2", "--snapshot-replicas") == 2
    for bad in ("0", "-1", "x", ""):
        with pytest.raises(SettingsError, match="at least 1"):
            parse_replicas(bad, "--snapshot-replicas")


# -- transport --------------------------------------------------------------------------------------
def _memfds(name: str) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name}"):
                n += 1
        except OSError:
            pass
    return n


def _peer_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("elastictk-peer", "elastictk-replicator"))]


@pytest.fixture
def server() -> Iterator[PeerServer]:
    fds_before = len(os.listdir("/proc/self/fd"))
    s = PeerServer("127.0.0.1", Replicas(64 << 20), TOKEN.encode(), JOB)
    try:
        yield s
    finally:
        s.close()
        s.replicas.close()  # the owner's (the agent's peer tier's) to close
        assert _peer_threads() == [], "threads left behind"
        assert _memfds("elastictk-replica") == 0, "replica memory left behind"
        assert len(os.listdir("/proc/self/fd")) <= fds_before, "sockets left behind"


def test_an_authenticated_put_is_kept_listed_and_served_back(server: PeerServer) -> None:
    part = os.urandom(3 << 20) + b"tail"
    c = PeerClient("127.0.0.1", server.port, TOKEN.encode(), JOB)
    try:
        c.put("node-a", 3, 4, 12, checksum(part), memoryview(part))
        assert c.index() == [Key("node-a", 3, 4, 12)]
        got, digest = c.get(3, 4, 12)
        assert bytes(got) == part and digest == checksum(part)
        with pytest.raises(WireError, match="has no rank 3's step 13"):
            c.get(3, 4, 13)
    finally:
        c.close()


@pytest.mark.parametrize("token", [None, b"another-token"])
def test_a_client_without_the_jobs_token_is_refused_and_logged_once(server: PeerServer, token: bytes | None,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "elastictk.snapshot")
    for _ in range(2):
        with pytest.raises(Refused):
            PeerClient("127.0.0.1", server.port, token, JOB)
    deadline = time.monotonic() + 5
    while not caplog.records and time.monotonic() < deadline:
        time.sleep(0.02)
    refusals = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refusals) == 1, refusals
    assert "does not know this job's rendezvous token" in refusals[0]
    assert server.replicas.index() == []


def test_a_server_without_the_token_is_not_trusted_by_a_client_that_has_it() -> None:
    s = PeerServer("127.0.0.1", Replicas(1 << 20), b"not-the-token", JOB)
    try:
        with pytest.raises(Refused):
            PeerClient("127.0.0.1", s.port, TOKEN.encode(), JOB)
    finally:
        s.close()


def test_a_corrupted_part_is_refused_by_its_checksum_and_not_kept(server: PeerServer) -> None:
    part = bytearray(os.urandom(1 << 20))
    digest = checksum(part)
    part[4096] ^= 0xFF  # one byte flipped on the way
    c = PeerClient("127.0.0.1", server.port, TOKEN.encode(), JOB)
    try:
        with pytest.raises(WireError, match=r"did not keep rank 0's step 5: .*torn \(checksum"):
            c.put("node-a", 0, 2, 5, digest, memoryview(part))
        assert server.replicas.index() == []
        good = bytes(os.urandom(1000))
        c.put("node-a", 0, 2, 6, checksum(good), memoryview(good))  # the connection goes on
        assert server.replicas.index() == [Key("node-a", 0, 2, 6)]
    finally:
        c.close()


def test_garbage_on_the_port_ends_that_connection_only(server: PeerServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.recv(4096)
        s.sendall(b"\xff\xff\xff\xff" + b"x" * 64)
        try:
            assert s.recv(4096) == b""  # the server hung up
        except ConnectionResetError:
            pass  # hung up with unread bytes: a reset
    c = PeerClient("127.0.0.1", server.port, TOKEN.encode(), JOB)
    c.close()


def test_a_replica_that_does_not_fit_the_memory_bound_is_refused_in_one_line() -> None:
    s = PeerServer("127.0.0.1", Replicas(1 << 20), TOKEN.encode(), JOB)
    try:
        c = PeerClient("127.0.0.1", s.port, TOKEN.encode(), JOB)
        part = bytes(2 << 20)
        with pytest.raises(WireError, match=r"refused rank 1's step 2: \"a replica of rank 1's step 2 \(2.1 MB\) "
                           r"does not fit: 0 B of 1.0 MB \(--snapshot-replica-memory, by default --snapshot-memory\) held or "
                           r"arriving; raise it\"$"):
            c.put("n", 1, 2, 2, checksum(part), memoryview(part))
        c.close()
    finally:
        s.close()


# -- two agents' tiers, in one process ------------------------------------------------------------------
class FakeMember:
    def __init__(self, node_id: str, rank: int, meta: dict[str, Any]) -> None:
        self.node_id, self.rank, self.meta = node_id, rank, meta


def _commit(region: Region, step: int, rank: int, world: int, payload: bytes) -> None:
    i = region.begin()
    region.data(i)[:len(payload)] = payload
    region.publish(i, step, len(payload), rank, world)
    region.seal(i)  # pokes the agent's pipe


def _wait(pred: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_sealed_slots_ship_to_the_ring_neighbour_and_a_replacement_fetches_them() -> None:
    holders = [Holder(1, 8 << 20) for _ in range(3)]
    tiers = [PeerTier(h, "127.0.0.1", TOKEN, JOB, 1, 8 << 20) for h in holders]
    try:
        members = [FakeMember(f"node{i}", i, {"addr": "127.0.0.1", **tiers[i].meta()}) for i in range(2)]
        for i in range(2):
            tiers[i].round(members, 2, f"node{i}", i, prefetch=True)
        worker = Region(holders[1].path, 0, holders[1].region, holders[1].memory, 1,
                        notify=tiers[1].env()[ENV_NOTIFY])
        parts = {s: os.urandom(100_000 + s) for s in (1, 2, 3)}
        for s in (1, 2, 3):  # node1's parts land on node0 (its ring neighbour) as they are sealed
            _commit(worker, s, 1, 2, parts[s])
            _wait(lambda: s in [k.step for k in tiers[0].replicas.index()])
        assert [k.step for k in tiers[0].replicas.index()] == [3], "the newest kept (3x the state per node)"
        assert {k.origin for k in tiers[0].replicas.index()} == {"node1"}
        worker.close()
        # node1 is lost; node2 (a spare) takes its place and its rank 1
        tiers[1].close()
        members = [members[0], FakeMember("node2", 1, {"addr": "127.0.0.1", **tiers[2].meta()})]
        tiers[0].round(members, 2, "node0", 0, prefetch=True)
        tiers[2].round(members, 2, "node2", 1, prefetch=True)
        mine = Region(holders[2].path, 0, holders[2].region, holders[2].memory, 1,
                      notify=tiers[2].env()[ENV_NOTIFY])
        ready = mine.ready(1, 2)
        assert [m.step for m in ready] == [3], "the newest step, fetched from the neighbour"
        for m in ready:
            assert mine.verify(m) is None
            assert bytes(mine.data(m.index)[:m.length]) == parts[m.step]
            assert mine.origin(m.index).startswith("peer 127.0.0.1 (fetched by the agent in ")
        # the spare now owns rank 1: its first own commit supersedes node1's replicas on node0
        _commit(mine, 4, 1, 2, parts[3])
        _wait(lambda: {k.origin for k in tiers[0].replicas.index()} == {"node2"})
        mine.close()
        # a round without node1 (and after the one that followed its loss) drops what is left of it
        tiers[0].replicas.keep(_replica(tiers[0].replicas, Key("node1", 0, 2, 9)))
        tiers[0].round(members, 2, "node0", 0, prefetch=False)
        assert all(k.origin != "node1" for k in tiers[0].replicas.index())
    finally:
        for t in (tiers[0], tiers[2]):
            t.close()
        for h in holders:
            h.close()
    assert _peer_threads() == []
    assert _memfds("elastictk-replica") == 0 and _memfds("elastictk-snapshots") == 0


def _replica(replicas: Replicas, key: Key) -> Any:
    rep = replicas.reserve(key, checksum(b"x"), 1)
    rep.data()[:] = b"x"
    return rep


# -- a whole host killed, on test hosts ---------------------------------------------------------------
STEPS = 40
PORT = 29400
CONF = "last_call_timeout=1,heartbeat_interval=0.2,heartbeat_timeout=2,join_timeout=60"


def _reference(steps: int = STEPS) -> list[Any]:
    """The fault-free weights, computed here: the job's math with its two equal gradients summed;
    then each rank's own tensor (peer_train.py's ``mine``: rank r adds (r + 1) * step)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        model(torch.ones(2, 4) * (step % 5) * 0.1).pow(2).sum().backward()
        for p in model.parameters():
            assert p.grad is not None
            p.grad.mul_(2)  # all_reduce over two ranks holding the same gradient: exact
        opt.step()
    mine = [torch.tensor([float((r + 1) * steps * (steps + 1) // 2)], dtype=torch.float64) for r in (0, 1)]
    return [p.detach().clone() for p in model.parameters()] + mine


def _fault_free(weights: list[Any], steps: int = STEPS) -> bool:
    import torch

    ref = _reference(steps)
    return len(weights) == len(ref) and all(torch.equal(a, b) for a, b in zip(weights, ref))


def _peer_port(pid: int, addr: str) -> list[int]:
    """The agent's listening ports on the host's address (read from the agent's own
    /proc/<pid>/net/tcp, which shows its network namespace)."""
    from elastictk.lifetime import procfs

    agent = next(p for p in [pid, *procfs.descendants(pid)] if "elastictk.run" in " ".join(procfs_cmdline(p)))
    inodes = set()
    for fd in os.listdir(f"/proc/{agent}/fd"):
        try:
            link = os.readlink(f"/proc/{agent}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    want = "".join(f"{int(x):02X}" for x in reversed(addr.split(".")))
    ports = []
    for line in Path(f"/proc/{agent}/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        ip_hex, port_hex = f[1].split(":")
        if f[3] == "0A" and f[9] in inodes and ip_hex == want:
            ports.append(int(port_hex, 16))
    return ports


def _says_hello(addr: str, port: int) -> bool:
    """Whether ``port`` opens with the peer tier's hello (the agent also listens for its stores)."""
    try:
        with socket.create_connection((addr, port), timeout=1) as s:
            return s.recv(4, socket.MSG_WAITALL) != b"" and b"elastictk-peer/1" in s.recv(4096)
    except OSError:
        return False


def _origins(host: Any, pid: int) -> set[str]:
    return {k.origin for k in _held(host, pid)}


def _held(host: Any, pid: int) -> list[Key]:
    """The replicas the agent of ``pid`` on ``host`` holds (its peer server's index)."""
    return _asker(host, pid)()


def _asker(host: Any, pid: int) -> Any:
    """A function that reads the index of the agent of ``pid`` on ``host`` (its port found once)."""
    ports = [p for p in _peer_port(pid, host.addr) if p != PORT]
    ours = host.call(lambda: [p for p in ports if _says_hello(host.addr, p)])
    assert len(ours) == 1, (ports, ours)
    port = ours[0]

    def ask() -> list[Key]:
        c = PeerClient(host.addr, port, TOKEN.encode(), "peerjob", timeout=5)
        try:
            return c.index()
        finally:
            c.close()
    return lambda: host.call(ask)


def procfs_cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


def _shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "elastictk" in n}


def _holds_memfd(pids: set[int]) -> list[int]:
    """Those of ``pids`` alive and holding elastictk snapshot memory (a memfd)."""
    out = []
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if "memfd:elastictk-" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                    out.append(pid)
                    break
        except OSError:
            continue
    return out


def _first_start_after(path: Path, wall: float) -> str:
    """What a rank restored at its first start after ``wall`` (``"<time> <step>"`` lines)."""
    for line in path.read_text().splitlines():
        t, restored = line.split()
        if float(t) > wall:
            return restored
    return "(no start after the fault)"


def _run_losing_a_host(tmp_path: Path, tiers: str, send_bps: dict[int, float] | None = None,
                       steps: int = STEPS, kill_at_replica: int = 0) -> dict[str, Any]:
    """3 test hosts, --nnodes 2:2 (host 2 a spare); host 1 killed whole at step 10, where the
    ranks hold until the test says go (a loaded machine starts the spare slowly). ``send_bps``:
    each host's sends throttled to that rate. ``kill_at_replica``: the ranks never hold; host 1
    is killed, while both ranks commit every step, as soon as host 0 holds a replica of rank 1's
    step of at least this."""
    import subprocess
    import sys

    from tests.helpers.netns import Hosts, leftover_namespaces, netns_works

    why = netns_works()
    if why is not None:
        pytest.skip(f"test hosts need working network namespaces: {why}")
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "out"
    out.mkdir()
    if kill_at_replica:
        (out / "go").touch()  # no hold: the job commits every step throughout
    shm_before = _shm()
    hosts = Hosts(3)
    agents: list[subprocess.Popen[str]] = []
    try:
        endpoint = f"{hosts[0].addr}:{PORT}"
        env = {**os.environ, "ELASTICTK_RDZV_TOKEN": TOKEN, "GLOO_SOCKET_IFNAME": "eth0"}

        def on(i: int) -> subprocess.Popen[str]:
            argv = [sys.executable, "-m", "elastictk.run", "--nnodes", "2:2", "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "peerjob",
                    "--rdzv-conf", CONF, "--start-method", "spawn", "--max-restarts", "3", "--snapshot", tiers,
                    "--snapshot-memory", "64M", "--event-log", str(tmp_path / f"events{i}.jsonl"),
                    str(root / "tests" / "helpers" / "peer_train.py"), str(out), str(steps)]
            rate = (send_bps or {}).get(i)
            p = hosts[i].popen(argv, env={**env, **({ENV_THROTTLE: str(rate)} if rate else {})}, cwd=root,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            agents.append(p)
            return p

        on(0)
        hosts[1].wait_listening(hosts[0].addr, PORT)
        on(1)

        def step(r: int) -> int:
            assert agents[0].poll() is None, "an agent ended early"
            try:
                return int((out / f"step-{r}").read_text())
            except (OSError, ValueError):
                return 0
        _wait(lambda: min(step(0), step(1)) >= 3, timeout=90)
        on(2)
        _wait(lambda: (tmp_path / "events2.jsonl").exists()
              and "spare_waiting" in (tmp_path / "events2.jsonl").read_text(), timeout=60)
        held: list[Key] = []
        if kill_at_replica:  # while the ranks commit: as soon as host 0 holds rank 1's step
            ask = _asker(hosts[0], agents[0].pid)

            def arrived() -> bool:
                held[:] = ask()
                return any(k.rank == 1 and k.step >= kill_at_replica for k in held)
            _wait(arrived, timeout=120)
        else:
            _wait(lambda: min(step(0), step(1)) >= 10, timeout=60)
        before = {k.origin for k in held} if held else (_origins(hosts[0], agents[0].pid) if "peer" in tiers else set())
        killed_at, killed_wall = step(1), time.time()
        from elastictk.lifetime import procfs

        tree = set(procfs.descendants(agents[1].pid)) | {agents[1].pid}
        assert _holds_memfd(tree), "the agent holds its snapshot memory"
        agent = next(p for p in sorted(tree) if "elastictk.run" in " ".join(procfs_cmdline(p)))
        os.kill(agent, signal.SIGKILL)  # the agent; its workers die with it: the host is gone
        (out / "go").touch()  # the ranks held after step 10 (peer_train.py) until the host was lost
        _wait(lambda: _holds_memfd(tree) == [], timeout=30)
        after: set[str] = set()
        if "peer" in tiers:  # the spare trains and ships rank 1's parts: the lost node's are dropped
            _wait(lambda: (out / "restored-1").exists() and step(1) >= killed_at + 3, timeout=90)
            after = _origins(hosts[0], agents[0].pid)
        errs: dict[int, str] = {}
        for i in (0, 2):
            try:
                _, errs[i] = agents[i].communicate(timeout=120)
            except subprocess.TimeoutExpired:
                agents[i].kill()
                _, errs[i] = agents[i].communicate()
        try:
            _, errs[1] = agents[1].communicate(timeout=30)  # killed: what it said before
        except subprocess.TimeoutExpired:
            errs[1] = ""
        result = {"rc": [agents[0].returncode, agents[2].returncode], "err0": errs[0], "err2": errs[2],
                  "err1": errs[1],
                  "restored": {r: _first_start_after(out / f"restored-{r}", killed_wall) for r in (0, 1)},
                  "killed_at": killed_at, "before": before, "after": after, "held": held,
                  "out": out}
        return result
    except AssertionError as e:
        for p in agents:
            if p.poll() is None:
                p.kill()
        logs = "\n---\n".join((p.communicate()[1] or "")[-2500:] for p in agents)
        raise AssertionError(f"{e}\nagent logs:\n{logs}") from None
    finally:
        hosts.close()
        assert leftover_namespaces(hosts.tag) == [], "namespaces left behind"
        assert _shm() - shm_before == set(), "nothing new in /dev/shm"


def test_a_whole_host_killed_its_rank_restores_on_the_spare_from_a_peer(tmp_path: Path) -> None:
    import torch

    r = _run_losing_a_host(tmp_path, "local,peer")
    assert r["rc"] == [0, 0], r["err0"][-3000:] + "\n---\n" + r["err2"][-3000:]
    restored = {k: int(v) for k, v in r["restored"].items()}
    assert restored[0] == restored[1] >= r["killed_at"] - 1, (restored, r["killed_at"])
    line = f"rank 1 restored step {restored[1]} from peer "
    assert line in r["err2"], r["err2"][-3000:]
    assert "fetched by the agent in" in r["err2"]
    assert f"rank 0 restored step {restored[0]} from local memory" in r["err0"]
    assert _fault_free(torch.load(r["out"] / "weights.pt")), "fault-free weights and each rank's own tensor"
    assert len(r["before"]) == 1, "host 0 held the lost host's replicas"
    assert len(r["after"]) == 1 and r["after"] != r["before"], "the lost node's replicas are dropped"
    print(f"rank 1 restored step {restored[1]} (host killed after step {r['killed_at']}) from a peer")


SLOW_STEPS = 80  # the job's length when its sends are slow: the host is lost near step 45
PART = 2200  # bytes of this job's part, about (model, momentum, step, each rank's tensor)


def _peer_story(r: dict[str, Any]) -> str:
    """Each host's snapshot lines (cadence, sends, fetches, restores), for a failure message that
    says what the peer tier did rather than a log's last lines."""
    def lines(text: str) -> str:
        keep = [ln for ln in text.splitlines()
                if any(w in ln for w in ("snapshot", "restored", "ships every", "replica", "fetch", "exit code"))]
        return "\n".join(keep)[-3000:]
    return "\n".join(f"--- {name}\n{lines(r[key])}" for name, key in
                     (("host 0", "err0"), ("host 1 (killed)", "err1"), ("host 2 (spare)", "err2")))


def test_a_host_lost_while_the_job_commits_and_its_sends_are_slower_than_the_steps_restores_from_its_replica(
        tmp_path: Path) -> None:
    """Each send takes ~1.8 s (host 1) and ~2.2 s (host 0) against steps of ~0.15 s, and the ranks
    never stop committing: the agents raise the job's cadence to a power of two covering two
    sends, so both ship the same steps, and each keeps the step it ships in its memory until the
    next one. Host 1 is killed as soon as host 0 holds its replica of such a step N: the spare
    restores rank 1 from that replica and rank 0 restores the same N, with the fault-free weights
    and each rank's own tensor (the job's state is per rank: another rank's copy would not do).
    Before (each agent shipping its newest slot as its sends allowed), the survivor's slots held
    other steps than the lost node's replica, and the ranks started from scratch."""
    import re

    import torch

    r = _run_losing_a_host(tmp_path, "local,peer", send_bps={0: PART / 2.2, 1: PART / 1.8},
                           steps=SLOW_STEPS, kill_at_replica=8)
    logs = r["err0"] + "\n---\n" + r["err2"]
    assert r["rc"] == [0, 0], logs[-4000:]
    assert "torn" not in r["err0"] + r["err1"] + r["err2"], logs[-4000:]
    replica = max(x.step for x in r["held"] if x.rank == 1)
    restored = {x: int(v) if v.isdigit() else v for x, v in r["restored"].items()}
    assert restored[0] == restored[1] == replica, (
        f"restored {restored}, host 0 held {r['held']} when host 1 was killed after step {r['killed_at']}\n"
        + _peer_story(r))
    said = [int(k) for k in re.findall(r"ships every (\d+)\w\w step", r["err1"])]
    assert said, "the cadence was raised: " + r["err1"][-3000:]
    k = max(said)
    assert replica % k == 0 and replica >= k >= 8, (replica, k)
    assert f"rank 1 restored step {replica} from peer " in r["err2"], r["err2"][-3000:]
    assert re.search(rf"rank 0 restored step {replica} from (local memory|peer |a replica)", r["err0"]), \
        r["err0"][-3000:]
    assert r["killed_at"] > replica, "killed while the job committed on past the replica's step"
    assert _fault_free(torch.load(r["out"] / "weights.pt"), SLOW_STEPS), "fault-free weights and own tensors"
    print(f"cadence {k}; host 1 killed after step {r['killed_at']}; both ranks restored step {replica}")


def test_the_same_loss_with_the_local_tier_only_gets_no_part_from_a_peer(tmp_path: Path) -> None:
    """The failing side of the peer tier: without it the spare's agent fetches nothing, and the
    spare's rank has no part of its own. This job's state is replicated (DDP-style), so the
    ranks still agree on the survivor's newest step and the spare receives the survivor's copy
    over the process group (docs/snapshots.md, another world size): never from a peer."""
    r = _run_losing_a_host(tmp_path, "local")
    assert r["rc"] == [0, 0], r["err0"][-3000:] + "\n---\n" + r["err2"][-3000:]
    assert "from peer" not in r["err0"] + r["err2"] and "fetched by the agent" not in r["err2"]
    restored = {k: int(v) for k, v in r["restored"].items()}
    assert restored[0] == restored[1], restored
    assert f"rank 1 restored step {restored[1]} from rank 0's local memory (over the process group)" \
        in r["err2"], r["err2"][-3000:]

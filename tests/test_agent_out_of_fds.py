"""An agent under a token holder's attack on its descriptors still reports its workers' outcome
(issue 36, finding 2).

The review's attack: a peer that holds the job's token sent 483 zero-byte parts to a real
agent's snapshot peer tier; each kept replica held a memfd and a mapping, the agent reached its
descriptor limit, crashed listing ``/proc`` in ``WorkerGroup.close()``, and the job exited 1
though its worker had finished. Here the agent's limit is lowered to what it holds plus 24 (so
the attack is cheap), the 483 parts are sent (each refused now, none kept), and then the
attacker opens every connection the peer tier allows it from five addresses: the peer tier
stops accepting while the agent has only a quarter of its limit left. The worker then
finishes and the job exits 0. (``/proc`` unreadable under EMFILE in the close path is
``tests/test_procfs_errors.py``.)
"""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from elastictk.snapshot.codec import checksum
from elastictk.snapshot.handshake import introduce
from elastictk.snapshot.wire import Late, WireError, recv, send

ROOT = Path(__file__).resolve().parent.parent
TOKEN, JOB = "fd-token", "fdjob"
WORKER = """
import sys, time
from pathlib import Path
go = Path(sys.argv[1])
(go.parent / "started").touch()
while not go.exists():
    time.sleep(0.05)
"""


def _wait(cond: Callable[[], bool], what: str, p: subprocess.Popen[str], timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert p.poll() is None, f"the agent ended while waiting for {what}: {p.communicate()[1][-3000:]}"
        assert time.monotonic() < end, f"no {what} within {timeout} s"
        time.sleep(0.05)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _listening(pid: int) -> list[int]:
    """The TCP ports process ``pid`` listens on (its socket inodes in /proc/<pid>/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and f[9] in inodes:
            out.append(int(f[1].split(":")[1], 16))
    return out


def _connect(port: int, source: str, within: float = 10) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.settimeout(within)
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        introduce(s, TOKEN.encode(), JOB, time.monotonic() + within)
    except BaseException:
        s.close()
        raise
    return s


def _zero_byte_parts(port: int, n: int) -> tuple[int, int]:
    """Send ``n`` zero-byte parts, reconnecting when the server hangs up; (kept, refused)."""
    kept = refused = 0
    s = None
    try:
        for world in range(1, n + 1):
            if s is None:
                s = _connect(port, "127.0.0.2")
            try:
                send(s, {"op": "put", "origin": "evil", "rank": 0, "world": world, "step": 1, "nbytes": 0,
                         "sum": checksum(b"")})
                if recv(s).get("ok") is True and recv(s).get("ok") is True:
                    kept += 1
                else:
                    refused += 1
            except (WireError, OSError):
                refused += 1
                s.close()
                s = None
    finally:
        if s is not None:
            s.close()
    return kept, refused


def test_an_agent_out_of_fds_under_a_token_holders_attack_exits_with_its_workers_outcome(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    go = tmp_path / "go"
    argv = [sys.executable, "-m", "elastictk.run", "--nnodes", "1", "--nproc-per-node", "1",
            "--rdzv-backend", "file", "--rdzv-endpoint", str(tmp_path / "store"), "--rdzv-id", JOB,
            "--rdzv-conf", "heartbeat_timeout=600", "--snapshot", "local,peer", "--snapshot-memory", "8M",
            str(worker), str(go)]
    p = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "ELASTICTK_RDZV_TOKEN": TOKEN},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    held: list[socket.socket] = []
    try:
        _wait(lambda: (tmp_path / "started").exists(), "worker start", p)
        ports = _listening(p.pid)
        assert len(ports) == 1, ports  # the file store listens nowhere: this is the peer tier's
        limit = _fds(p.pid) + 24
        resource.prlimit(p.pid, resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        kept, refused = _zero_byte_parts(ports[0], 483)
        assert (kept, refused) == (0, 483), "zero-byte parts were kept"
        assert _fds(p.pid) < limit - 8, "refused parts left descriptors behind"
        peak, waiting = 0, 0
        for a in range(2, 7):  # every authenticated connection five peers may have: past the limit
            for _ in range(16):
                try:
                    held.append(_connect(ports[0], f"127.0.0.{a}", within=3))
                except Late:  # left in the listen backlog: the agent keeps its last descriptors
                    waiting += 1
                except (WireError, OSError):
                    pass
                peak = max(peak, _fds(p.pid))
                if waiting >= 2:
                    break
            if waiting >= 2:
                break
        go.touch()
        _, err = p.communicate(timeout=180)
    finally:
        for s in held:
            s.close()
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert "file descriptors left: not accepting connections" in err, err[-3000:]  # it was attacked
    assert peak < limit, f"the agent reached its limit ({peak} of {limit} descriptors)"
    assert p.returncode == 0, err[-3000:]  # the worker's outcome
    assert "Traceback" not in err and "Too many open files" not in err, err[-3000:]

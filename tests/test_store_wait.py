"""A node that does not host the c10d store waits for the node that does, as torch's client does:
nodes start in any order. It waits only for a connect that nothing takes (the host is not up
yet); a program on the port that does not answer as a TCPStore is reported at once."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from elastictk.store import Endpoint, quiet_port
from elastictk.store.tcp import TCPStore
from elastictk.store.wait import wait_for_store

ROOT = Path(__file__).resolve().parent.parent


def test_a_store_whose_host_starts_late_is_waited_for_and_said_once() -> None:
    port = quiet_port()
    lines: list[str] = []
    server: list[TCPStore] = []
    late = threading.Timer(1.0, lambda: server.append(TCPStore.serve("127.0.0.1", port)))
    late.start()
    try:
        start = time.monotonic()
        assert wait_for_store(Endpoint("127.0.0.1", port), 20.0, lines.append) is None  # it found it
        assert 0.9 < time.monotonic() - start  # it waited (no upper bound: a loaded host is slow)
    finally:
        late.join()
        for s in server:
            s.close()
    assert len(lines) == 1 and f"waiting up to 20s for the store at 127.0.0.1:{port}" in lines[0], lines
    assert "connection refused" in lines[0]


def test_nothing_listening_is_waited_for_until_the_timeout_then_named() -> None:
    port = quiet_port()
    start = time.monotonic()
    reason = wait_for_store(Endpoint("127.0.0.1", port), 1.0, lambda _: None)
    assert reason is not None and "refused" in reason
    assert 1.0 <= time.monotonic() - start < 60  # its timeout, then it stops: a hang guard only


def test_a_program_on_the_port_that_is_not_a_store_is_reported_without_waiting() -> None:
    with socket.socket() as s:  # the kernel accepts connections; nobody ever answers
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        lines: list[str] = []
        start = time.monotonic()
        reason = wait_for_store(Endpoint("127.0.0.1", s.getsockname()[1]), 60.0, lines.append)
    assert reason is not None and "no TCPStore answer" in reason
    # Not waited for: no "waiting" line (the event), and less than the 60 s it would have waited.
    assert lines == [] and time.monotonic() - start < 60


def test_a_node_started_before_the_stores_host_waits_and_the_job_runs(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import os, torch.distributed as dist\n"
                      "dist.init_process_group('gloo'); dist.barrier()\n"
                      "open(os.path.join(os.environ['OUT'], os.environ['RANK']), 'w').close()\n"
                      "dist.destroy_process_group()\n")
    port = quiet_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTICTK_"))}
    env["OUT"] = str(tmp_path)

    def agent(is_host: bool) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "elastictk.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "late-host",
             "--rdzv-conf", f"is_host={str(is_host).lower()},read_timeout=60,last_call_timeout=1",
             str(script)], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)

    other = agent(False)
    host = None
    try:
        # The event, not a 2 s sleep (a loaded host takes longer to start Python): the other node
        # says it waits for the store, then its host starts.
        seen = []
        assert other.stderr is not None
        for line in other.stderr:
            seen.append(line)
            if "waiting up to" in line:
                break
        host = agent(True)
        host_err = host.communicate(timeout=240)[1]
        other_err = "".join(seen) + other.communicate(timeout=240)[1]
    finally:
        for p in (other, host):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert (other.returncode, host.returncode) == (0, 0), other_err + host_err
    assert other_err.count(f"waiting up to 60s for the store at 127.0.0.1:{port}") == 1, other_err
    assert "waiting up to" not in host_err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name in ("0", "1")) == ["0", "1"]

"""An agent that cannot start fails: elastictk-run with a c10d endpoint nobody listens on waits
``read_timeout`` for it, then exits non-zero with one line naming the endpoint, and starts no worker.

No external dependency: the endpoint is a loopback port held by a bound socket that never
listens (so no other process can take it while the test runs, and a connection is refused).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_an_unreachable_c10d_endpoint_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text("print('tiny worker ran')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTICTK_"))}
    with socket.socket() as held:  # bound, not listening: connecting is refused
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-m", "elastictk.run", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{port}", "--rdzv-id", "unreachable", "--nnodes", "1",
             "--rdzv-conf", "is_host=false,read_timeout=2,join_timeout=5", str(script)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
    assert r.returncode != 0, f"an agent that could not start exited {r.returncode}:\n{r.stderr}"
    assert r.returncode == 2, r.stderr  # the endpoint flag's value: bad input
    assert "Traceback" not in r.stderr, r.stderr
    # a node that does not host the store waits read_timeout for it, as torch's client does,
    # saying so once; then one error line
    waiting, error = r.stderr.splitlines()
    assert f"waiting up to 2s for the store at 127.0.0.1:{port}" in waiting, r.stderr
    assert error.startswith("elastictk-run: error: "), error
    assert f"127.0.0.1:{port}" in error and "--rdzv-endpoint" in error, error
    assert "tiny worker ran" not in r.stdout
    assert 2 <= took < 30, f"took {took:.1f}s with read_timeout=2"

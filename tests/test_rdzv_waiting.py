"""While a multi-node start waits for nodes, every waiting node says how many have joined and
how many more it needs, every few seconds (elastictk.rendezvous.waiting)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from elastictk.rendezvous.waiting import EVERY, FAST_FOR, FIRST_AFTER, LATER, WaitingReporter, waiting_line
from elastictk.store import quiet_port

LINE = re.compile(r"\[elastictk-run\] waiting for nodes: 1 of min 2 joined \(round 1\), 1 more needed; "
                  r"(\d+) s left of --rdzv-conf join_timeout; no other node has joined rdzv-id "
                  r"'waiting' yet: every node needs the same --rdzv-id and --rdzv-endpoint$")


def test_the_line_says_who_is_in_and_what_is_missing() -> None:
    assert waiting_line(1, 1, 3, 4, 24.6, 30) == (
        "waiting for nodes: 1 of min 3 joined (round 1), 2 more needed; 25 s left of --rdzv-conf "
        "join_timeout")
    assert waiting_line(2, 3, 2, 4, 10, 30) == (
        "waiting for nodes: 3 joined, min 2 met (round 2); it closes when max 4 have joined, or "
        "--rdzv-conf last_call_timeout (30 s) after the min was met")
    assert "0 s left" in waiting_line(1, 0, 1, 1, -3, 30)
    # alone under its --rdzv-id: a node given another id waits under its own, unseen here
    alone = waiting_line(1, 1, 2, 2, 20, 30, "job-7")
    assert alone.endswith("; no other node has joined rdzv-id 'job-7' yet: every node needs the "
                          "same --rdzv-id and --rdzv-endpoint"), alone
    assert "rdzv-id" not in waiting_line(1, 2, 3, 3, 20, 30, "job-7")


def test_the_lines_are_throttled() -> None:
    r = WaitingReporter(since=100.0)
    assert not r.due(100.0) and not r.due(100.0 + FIRST_AFTER - 0.01)
    assert r.due(100.0 + FIRST_AFTER) and not r.due(100.0 + FIRST_AFTER + EVERY - 0.01)
    assert r.due(100.0 + FIRST_AFTER + EVERY)
    late = 100.0 + FAST_FOR + 1
    assert r.due(late) and not r.due(late + LATER - 0.01) and r.due(late + LATER)


def _node(tmp: Path, port: int, script: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTICTK_"))}
    return subprocess.Popen(
        [sys.executable, "-m", "elastictk.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "waiting",
         "--rdzv-conf", "join_timeout=600", str(script)],  # the second node may start minutes late
        cwd=tmp, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_node_waiting_for_a_late_one_says_so(tmp_path: Path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text("print('tiny worker ran')\n")
    port = quiet_port()
    first = _node(tmp_path, port, script)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        assert first.stderr is not None
        for line in first.stderr:
            lines.append(line.rstrip("\n"))
            if LINE.match(lines[-1]):
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    second: subprocess.Popen[str] | None = None
    try:
        # The line is the event; its deadline covers a loaded host's start-up of the first node.
        assert seen.wait(FIRST_AFTER + 240), "no waiting line:\n" + "\n".join(lines)
        match = next(m for m in map(LINE.match, lines) if m)
        assert 0 < int(match.group(1)) <= 600
        second = _node(tmp_path, port, script)
        out2, err2 = second.communicate(timeout=240)
        assert second.returncode == 0, err2[-3000:]
        assert first.wait(timeout=240) == 0, "\n".join(lines)[-3000:]
        reader.join(timeout=10)
        assert "tiny worker ran" in out2 and "waiting for nodes" not in err2
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        if first.stdout is not None:
            first.stdout.close()


def test_a_round_that_forms_at_once_says_nothing(tmp_path: Path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text("print('tiny worker ran')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTICTK_"))}
    r = subprocess.run([sys.executable, "-m", "elastictk.run", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", "127.0.0.1:0", "--nnodes", "1", str(script)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "waiting for nodes" not in r.stderr, r.stderr[-2000:]

"""--nnodes and --max-restarts must be the same on every node of a job: a node that is not rank
0 compares its own with rank 0's join record when a round closes, and a difference ends the
job with one line naming both values (it was silently each node's own)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.agent.shared_flags import mismatch, shared_flags
from elastictk.store import quiet_port

ROOT = Path(__file__).resolve().parent.parent


def test_the_values_each_node_carries_and_the_line() -> None:
    mine = {**shared_flags(2, 2, 3), "host": "b"}
    assert mine == {"nnodes": "2", "max_restarts": 3, "host": "b"}
    assert shared_flags(2, 4, 0)["nnodes"] == "2:4"
    assert mismatch(mine, {**shared_flags(2, 2, 3), "host": "a"}) is None
    line = mismatch(mine, {**shared_flags(3, 3, 3), "host": "a"})
    assert line == ("--nnodes differs between this job's nodes: --nnodes 2 on host 'b', --nnodes 3 "
                    "on rank 0's host 'a'; give every node the same --nnodes and relaunch them all")
    line = mismatch(mine, {**shared_flags(2, 2, 1), "host": "a"})
    assert line is not None and "--max-restarts 3 on host 'b', --max-restarts 1 on rank 0's" in line
    assert mismatch(mine, {"host": "a"}) is None  # a node that does not say: nothing to compare


@given(st.dictionaries(st.sampled_from(["nnodes", "max_restarts", "host", "addr"]),
                       st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=300),
                                 st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                                       max_size=2))))
@settings(max_examples=400, deadline=None)
def test_any_record_from_the_store_is_compared_without_raising_and_shown_bounded(leader: dict) -> None:
    mine = {**shared_flags(2, 3, 5), "host": "me"}
    line = mismatch(mine, leader)
    if line is None:
        return
    assert "\n" not in line and len(line) < 400, line
    key = "nnodes" if "--nnodes differs" in line else "max_restarts"
    assert leader.get(key) != mine[key] and type(leader[key]) is (str if key == "nnodes" else int)


def _node(tmp: Path, port: int, restarts: int, host: bool, script: Path,
          *flags: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTICTK_"))}
    return subprocess.Popen(
        [sys.executable, "-m", "elastictk.run", "--nnodes", "2", "--max-restarts", str(restarts),
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "shared", *flags,
         "--rdzv-conf", f"is_host={int(host)},join_timeout=120", str(script)],
        cwd=tmp, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(nodes: list[subprocess.Popen[str]]) -> tuple[list[tuple[str, str]], str]:
    """Each node's (stdout, stderr) once all have exited (killed past 240 s), and both nodes'
    stderr tails with their exit codes, for a failing assertion's message."""
    try:
        done = [n.communicate(timeout=240) for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
                n.wait()
    both = "\n".join(f"--- node {i} (exit {n.returncode}):\n{e[-3000:]}" for i, (n, (_, e)) in enumerate(zip(nodes, done)))
    return done, both


def test_the_store_host_that_finds_the_difference_leaves_its_peer_the_line(tmp_path: Path) -> None:
    """The node hosting the c10d store is not rank 0 and finds the difference: its store goes
    when it exits, so it leaves first and waits for rank 0 to read why. A loaded make test
    failed here: rank 0 ended with "store lost" (the host's wait never ran: it read the round
    before its loop had joined one; and once it did, rank 0, whose workers ran, waited for a
    membership change that the still-beating host never made). The host joins after the
    other node started its rendezvous (a health check that waits for that event), so it is
    the one that finds the difference."""
    script = tmp_path / "w.py"
    script.write_text("import time\ntime.sleep(120)\n")
    port, events = quiet_port(), tmp_path / "other.jsonl"
    wait = f"until grep -q rendezvous_started {events}; do sleep 0.05; done; sleep 1"
    nodes = [_node(tmp_path, port, 3, True, script, "--health-check", f"sh -c '{wait}'"),
             _node(tmp_path, port, 1, False, script, "--event-log", str(events))]
    done, both = _finish(nodes)
    assert [n.returncode for n in nodes] == [2, 1], f"the host did not find the difference (premise)\n{both}"
    for _, err in done:
        assert "--max-restarts differs between this job's nodes" in err, both
        assert "Traceback" not in err, both


def test_two_nodes_with_different_max_restarts_end_with_the_line(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    # a job that trains a while: the mismatched node shuts it down; a job this node's workers
    # end before that shutdown reaches rank 0's node ends there with its own outcome (0)
    script.write_text("import time\ntime.sleep(120)\nprint('trained')\n")
    port = quiet_port()
    nodes = [_node(tmp_path, port, 3, True, script), _node(tmp_path, port, 1, False, script)]
    done, both = _finish(nodes)
    says = "--max-restarts differs between this job's nodes"
    codes = sorted(n.returncode for n in nodes)
    assert codes == [1, 2], (codes, [e[-2000:] for _, e in done])
    for _, err in done:  # the node that found it exits 2 with the line; rank 0 ends with it
        assert says in err and "give every node the same --max-restarts" in err, both
        assert "Traceback" not in err, err[-3000:]

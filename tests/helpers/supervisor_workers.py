"""Tiny worker functions and scripts for the worker-group tests (no torch, no pytest imports:
a spawned worker imports this module, and it must start fast)."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

ENV_KEYS = (
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES", "EXTRA",
)


def report_env(tag: str) -> dict[str, Any]:
    """Return the torchrun variables this worker sees, and print a line per stream."""
    print(f"out {tag} rank={os.environ['RANK']}")
    print(f"err {tag} rank={os.environ['RANK']}", file=sys.stderr)
    return {"tag": tag, "pid": os.getpid(), "sid": os.getsid(0),
            "env": {k: os.environ.get(k) for k in ENV_KEYS}}


def big_value(n: int) -> bytes:
    """A return value far larger than a pipe buffer."""
    return b"x" * n


def fail(how: str) -> None:
    """End this worker the way ``how`` says, for rank 1 only; other ranks wait to be stopped."""
    if os.environ["LOCAL_RANK"] != "1":
        time.sleep(600)
        return
    if how == "exception":
        raise ValueError("worker failed on purpose")
    if how == "exit3":
        sys.exit(3)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "sigsegv":
        import ctypes

        ctypes.string_at(0)
    time.sleep(600)


def touch_and_sleep(directory: str) -> Optional[int]:
    Path(directory, f"ready.{os.environ['LOCAL_RANK']}").write_text(str(os.getpid()))
    time.sleep(600)
    return None


# A script worker that reports its environment and exits with a code from the environment.
ENV_SCRIPT = """\
import json, os, sys
print("hello from", os.environ["RANK"], "argv", sys.argv[1:], flush=True)
print("to stderr", os.environ["RANK"], file=sys.stderr, flush=True)
print("partial line without newline", end="", flush=True)
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""

# Fails in a way chosen by argv[1] on local rank 1; other ranks sleep until stopped.
FAIL_SCRIPT = """\
import os, signal, sys, time
if os.environ["LOCAL_RANK"] != "1":
    time.sleep(600)
how = sys.argv[1]
if how == "exception":
    raise ValueError("worker failed on purpose")
if how == "exit3":
    sys.exit(3)
if how == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "sigsegv":
    import ctypes
    ctypes.string_at(0)
"""

# Starts grandchildren: one in its session, one in a new process group, and one orphaned
# (its parent exits) in a new process group; writes all pids, then sleeps.
TREE_SCRIPT = """\
import os, subprocess, sys, time
d = sys.argv[1]
lr = os.environ["LOCAL_RANK"]
sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
same = subprocess.Popen(sleep)
own_group = subprocess.Popen(sleep, process_group=0)
r, w = os.pipe()
mid = os.fork()
if mid == 0:
    os.setpgid(0, 0)
    orphan = os.fork()
    if orphan == 0:
        os.close(r)
        os.close(w)
        os.execv(sys.executable, sleep)
    os.write(w, str(orphan).encode())
    os._exit(0)
os.close(w)
orphan = int(os.read(r, 64))
os.waitpid(mid, 0)
with open(os.path.join(d, f"tree.{lr}.tmp"), "w") as f:
    f.write(" ".join(str(p) for p in (os.getpid(), same.pid, own_group.pid, orphan)))
os.rename(os.path.join(d, f"tree.{lr}.tmp"), os.path.join(d, f"tree.{lr}"))
time.sleep(600)
"""

# On SIGTERM: either ignore it, or clean up for CLEANUP seconds and exit 0.
TERM_SCRIPT = """\
import os, signal, sys, time
d, mode = sys.argv[1], sys.argv[2]
lr = os.environ["LOCAL_RANK"]
def cleanup(signum, frame):
    time.sleep(float(os.environ.get("CLEANUP", "1")))
    open(os.path.join(d, f"cleaned.{lr}"), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore" else cleanup)
def usr1(signum, frame):
    sys.exit(7)
signal.signal(signal.SIGUSR1, usr1)
open(os.path.join(d, f"ready.{lr}"), "w").close()
while True:
    time.sleep(600)
"""


def run_tree(directory: str) -> None:
    """TREE_SCRIPT as a function worker."""
    sys.argv = ["tree", directory]
    exec(compile(TREE_SCRIPT, "tree", "exec"), {"__name__": "__main__"})

# Exits at once on SIGTERM, leaving behind a grandchild that ignores SIGTERM.
STUBBORN_GRANDCHILD_SCRIPT = """\
import os, signal, subprocess, sys, time
d = sys.argv[1]
code = ("import os, signal, sys, time\\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
        "open(sys.argv[1], 'w').close()\\n"
        "time.sleep(600)\\n")
ready = os.path.join(d, "grandchild.ready")
child = subprocess.Popen([sys.executable, "-c", code, ready])
while not os.path.exists(ready):
    time.sleep(0.01)
with open(os.path.join(d, "grandchild.pid"), "w") as f:
    f.write(str(child.pid))
time.sleep(600)
"""


def freeze_mid_send(n: int, half: int) -> bytes:
    """Return ``n`` bytes, but stop this process (SIGSTOP) after the length header and ``half``
    bytes of the pickle (less than a pipe buffer) are on the result pipe."""
    from multiprocessing.connection import Connection

    def send_half_then_stop(self: Any, buf: Any) -> None:
        data = bytes(buf)
        head = len(data).to_bytes(4, "big", signed=True)
        first = head + data[:half]
        fd = self.fileno()
        done = 0
        while done < len(first):
            done += os.write(fd, first[done:])
        os.kill(os.getpid(), signal.SIGSTOP)
        rest = data[half:]
        done = 0
        while done < len(rest):
            done += os.write(fd, rest[done:])

    Connection._send_bytes = send_half_then_stop  # type: ignore[method-assign]
    return b"x" * n


# Starts a grandchild that calls setsid and outlives its parent (so it is reparented to the
# agent, the subreaper), writes its pid, and exits after a moment: an orphan in no worker's
# session. Rank 1 exits 3 after EXIT_AFTER seconds; rank 0 sleeps until stopped.
SETSID_ORPHAN_SCRIPT = """\
import os, sys, time
d = sys.argv[1]
lr = os.environ["LOCAL_RANK"]
if lr == "1":
    time.sleep(float(os.environ.get("EXIT_AFTER", "1")))
    sys.exit(3)
mid = os.fork()
if mid == 0:
    if os.fork() == 0:
        os.setsid()
        time.sleep(0.5)  # its parent is gone by now: reparented to the agent
        with open(os.path.join(d, "orphan.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(d, "orphan.tmp"), os.path.join(d, "orphan.pid"))
        os._exit(0)
    os._exit(0)
os.waitpid(mid, 0)
time.sleep(600)
"""

# The first run of a rank exits 3 (leaving a marker); a replacement sleeps until stopped.
FIRST_RUN_FAILS_SCRIPT = """\
import os, sys, time
marker = os.path.join(sys.argv[1], "ran." + os.environ["LOCAL_RANK"])
if not os.path.exists(marker):
    open(marker, "w").close()
    sys.exit(3)
time.sleep(600)
"""

"""Fails until restart ``--until``; at restarts 2 and ``--until`` rank 0 records how many
sockets the agent (``--agent`` PID) holds, so a test sees whether restarts leak them."""
from __future__ import annotations

import argparse
import os
import sys

p = argparse.ArgumentParser()
p.add_argument("--agent", type=int, required=True)
p.add_argument("--until", type=int, required=True)
p.add_argument("--out", required=True)
args = p.parse_args()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if os.environ["RANK"] == "0" and restart in (2, args.until):
    fds = os.listdir(f"/proc/{args.agent}/fd")
    sockets = sum(1 for fd in fds if os.readlink(f"/proc/{args.agent}/fd/{fd}").startswith("socket:"))
    with open(args.out, "a") as f:
        f.write(f"{restart} {sockets}\n")
sys.exit(1 if restart < args.until else 0)

"""Run a command while CPU hogs keep every core busy: ``make test-loaded``.

    python -m tests.helpers.loaded [--hogs N] -- COMMAND...

Why: agents run beside data loaders that take every core, so the suite must hold there too
(heartbeats, watches and timers keep their promises; tests wait on events, not on bounds tuned
to an idle machine). One busy process per core (``os.cpu_count()`` unless ``--hogs``), each at
normal priority, is started before the command and killed by PID after it, whatever its exit;
each hog also gets a death signal, so a SIGKILLed wrapper leaves none behind. The command's exit
code is ours; one line says how long it took and the load it ran under.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

#: A hog: dies with its parent (PR_SET_PDEATHSIG = 1), then spins at normal priority.
HOG = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):  # the parent died before the death signal was set
    sys.exit(0)
while True:
    pass
"""


def start_hogs(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-I", "-S", "-c", HOG, str(os.getpid())],
                             stdin=subprocess.DEVNULL) for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen[bytes]]) -> None:
    for h in hogs:
        if h.poll() is None:
            h.kill()  # by its PID: Popen holds it and has not reaped it, so it is still ours
    for h in hogs:
        h.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.helpers.loaded", description=__doc__.splitlines()[0])
    p.add_argument("--hogs", type=int, default=os.cpu_count() or 1,
                   help="busy processes to run beside the command (default: one per core)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given: put it after --, e.g. -- pytest -q tests/test_store_wait.py")
    if args.hogs < 0:
        p.error(f"--hogs {args.hogs}: give 0 or more busy processes")
    hogs = start_hogs(args.hogs)
    started = time.monotonic()
    code = 1
    try:
        code = subprocess.call(command)
    except KeyboardInterrupt:
        code = 130
    except OSError as e:
        print(f"loaded: cannot run {command[0]}: {e.strerror or e}", file=sys.stderr)
        code = 2
    finally:
        stop_hogs(hogs)
    took = time.monotonic() - started
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"loaded: {' '.join(command[:3])}... exit {code} in {took:.0f} s beside {args.hogs} busy "
          f"process(es); load average now {load}", file=sys.stderr)
    return code


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SystemExit: the finally stops the hogs
    sys.exit(main())

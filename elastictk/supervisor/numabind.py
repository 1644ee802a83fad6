"""``python -m elastictk.supervisor.numabind MODE -- ARGV...``: a worker bound near its GPU.

``elastictk-run --numa-binding MODE`` (as torchrun's: ``node``, ``socket``, ``exclusive``,
``core-complex``) puts this in front of every worker's command: it binds the process to the
logical CPUs torch's own ``torch.numa.binding`` picks for the GPU ``LOCAL_RANK`` names (the same
choice torchrun makes), then execs the worker's command, which keeps that affinity. The binding
initializes CUDA in this short-lived process only; the worker starts fresh. A binding that fails
is one line and exit 1 (the agent's restart policy applies), never a worker on the wrong CPUs
without a word.
"""
from __future__ import annotations

import os
import sys

MODES = ("node", "socket", "exclusive", "core-complex")


def command(mode: str, argv: list[str], python: str = sys.executable) -> list[str]:
    """The worker command ``argv`` behind the binding."""
    return [python, "-m", __name__.replace("__main__", "elastictk.supervisor.numabind"), mode, "--", *argv]


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] not in MODES or argv[1] != "--":
        print(f"elastictk numabind: usage: MODE -- COMMAND... (MODE one of {', '.join(MODES)}); got "
              f"{' '.join(argv)[:200]}", file=sys.stderr)
        return 2
    mode, cmd = argv[0], argv[2:]
    gpu = int(os.environ.get("LOCAL_RANK", "0") or 0)
    try:
        from torch.numa.binding import AffinityMode, NumaOptions, _get_logical_cpus_to_bind_to

        cpus = _get_logical_cpus_to_bind_to(gpu_index=gpu, numa_options=NumaOptions(affinity_mode=AffinityMode(mode)))
        os.sched_setaffinity(0, cpus)
    except Exception as e:  # noqa: BLE001 - torch's binding raises whatever the host lacks
        print(f"elastictk-run: --numa-binding {mode}: cannot bind local rank {gpu} near GPU {gpu}: "
              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; leave --numa-binding out",
              file=sys.stderr)
        return 1
    os.execvp(cmd[0], cmd)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

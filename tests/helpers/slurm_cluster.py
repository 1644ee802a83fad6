"""A real Slurm cluster on network-namespace hosts: the controller on one host, a slurmd on
each of the others (tests/test_slurm_real.py)."""
from __future__ import annotations

from pathlib import Path

from elastictk.testing.slurm import SlurmCluster, SlurmHost, missing_binaries
from tests.helpers.netns import Hosts, netns_works


def why_not() -> str | None:
    """None when a real Slurm cluster can be started here, else why not (a skip reason)."""
    missing = missing_binaries()
    if missing:
        return f"no {', '.join(missing)}: apt-get install slurm-wlm munge (make debs)"
    return netns_works()


def start(nodes: int, base: Path) -> tuple[Hosts, SlurmCluster]:
    """``nodes`` + 1 hosts: ``ctl`` (slurmctld, and where clients run) and ``n1``..``nN``."""
    hosts = Hosts(nodes + 1)
    try:
        ctl = SlurmHost("ctl", hosts[0].addr, hosts[0].ns)
        compute = [SlurmHost(f"n{i}", hosts[i].addr, hosts[i].ns) for i in range(1, nodes + 1)]
        cluster = SlurmCluster(ctl, compute, base_dir=base)
        cluster.start()
    except BaseException:
        hosts.close()
        raise
    return hosts, cluster

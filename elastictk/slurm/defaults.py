"""``elastictk-run``'s rendezvous defaults under ``srun``: the job says how its nodes meet.

Every task of an ``srun`` step runs the same command line, so whatever a node needs that
differs between nodes (its id, whether it hosts the store) or that the user would copy from
Slurm by hand (the node count, the job id, the first host) comes from the job's variables.
Pure: the caller applies :class:`LaunchDefaults` to the flags it has not been given, so a flag
given explicitly always wins, and prints :attr:`LaunchDefaults.line`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .env import SlurmJob

#: The c10d store's port: torch's 29400 plus the job id modulo this, so two jobs that share a
#: node (a partial-node allocation) do not meet on one port.
PORT_BASE = 29400
PORT_SPREAD = 1000
#: The flags that say where nodes meet: any one given and elastictk takes no rendezvous default
#: from Slurm (the user chose another way).
WHERE_FLAGS = ("rdzv_backend", "rdzv_endpoint", "standalone", "master_addr", "master_port")
#: Of those, the ones that only move the meeting place (another port, another backend): the
#: job is still the Slurm job, so its node count and id are still taken (--nnodes, --rdzv-id).
MOVED_FLAGS = ("rdzv_backend", "rdzv_endpoint")


def store_port(job_id: str) -> int:
    return PORT_BASE + int(job_id) % PORT_SPREAD


def node_id(job: SlurmJob) -> str | None:
    """This node's rendezvous id: its Slurm name (``-task<N>`` for a second task on it)."""
    if job.node_name is None:
        return None
    return job.node_name if not job.localid else f"{job.node_name}-task{job.localid}"


@dataclass(frozen=True)
class LaunchDefaults:
    """Flag values (argparse dests, as text) taken from Slurm, and the line that says so."""

    values: dict[str, str] = field(default_factory=dict)
    node_id: str | None = None
    line: str = ""
    problem: str | None = None  # the allocation cannot hold the job: one line, exit 2


def launch_defaults(job: SlurmJob, given: dict[str, object]) -> LaunchDefaults | None:
    """What to take from ``job`` for the flags not in ``given`` (dest -> value or None), or
    None when the user chose another way for nodes to meet (``--standalone``, a static
    ``--master-addr``/``--master-port``). ``--rdzv-endpoint``/``--rdzv-backend`` given (another
    port, another store) keep the job's node count and id (:data:`MOVED_FLAGS`)."""
    chosen = [d for d in WHERE_FLAGS if given.get(d) not in (None, False)]
    if any(d not in MOVED_FLAGS for d in chosen) or given.get("rdzv_backend") == "static":
        return None  # static: the user numbers the nodes (--node-rank), as outside Slurm
    values: dict[str, str] = {}
    said: list[str] = []
    if given.get("nnodes") is None:
        values["nnodes"] = str(job.nnodes)
        said.append(f"--nnodes {job.nnodes}")
    if given.get("rdzv_id") is None:
        values["rdzv_id"] = job.job_id
        said.append(f"--rdzv-id {job.job_id}")
    nid = node_id(job)
    problem = None
    if chosen:
        if given.get("rdzv_backend") is None:  # only the endpoint moved: still the job's c10d store
            values["rdzv_backend"] = "c10d"
            said.append("--rdzv-backend c10d")
        said.append(" ".join(f"--{d.replace('_', '-')} {given[d]}" for d in chosen) + " as given")
    else:
        endpoint = f"{job.first_host}:{store_port(job.job_id)}"
        values.update(rdzv_backend="c10d", rdzv_endpoint=endpoint)
        said.append(f"--rdzv-backend c10d --rdzv-endpoint {endpoint}")
        if job.node_name is not None:
            values["is_host"] = "1" if job.node_name == job.first_host and not job.localid else "0"
            problem = _not_listed(job, endpoint)
    if nid is not None:
        said.append(f"node id {nid}")
    spares, too_few = _spares(job, given.get("nnodes"))
    problem = problem or too_few
    line = (f"under Slurm job {job.job_id} step {job.step_id} ({job.nnodes} node(s), "
            f"{job.nodelist_var} expanded by {job.expanded_by}): {' '.join(said)}{spares}; "
            "flags given explicitly win")
    return LaunchDefaults(values, nid, line, problem)


def _not_listed(job: SlurmJob, endpoint: str) -> str | None:
    """A node whose Slurm name is not in the step's node list cannot tell whether it is the
    first node, the store's host: every node would then wait for a store nobody hosts, up to the
    join timeout, saying nothing. One line instead, naming both and the way out."""
    if job.node_name in job.hosts:
        return None
    shown = ", ".join(job.hosts[:4]) + (", ..." if len(job.hosts) > 4 else "")
    return (f"this node's SLURMD_NODENAME {job.node_name!r} is not in {job.nodelist_var} ({shown}): "
            f"elastictk cannot tell whether it hosts the c10d store at {endpoint} (the first "
            "node does); give --rdzv-endpoint HOST:PORT naming the first node as every node "
            "reaches it, or fix the node names Slurm reports")


def _spares(job: SlurmJob, nnodes: object) -> tuple[str, str | None]:
    """The spare nodes ``--nnodes MIN:MAX`` leaves in this step, or why it cannot run."""
    if not isinstance(nnodes, str):
        return "", None
    lo, _, hi = nnodes.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        return "", None  # the flag's own check says what is wrong with it
    if low > job.nnodes:
        return "", (f"--nnodes {nnodes} needs at least {low} nodes, and Slurm job {job.job_id}'s "
                    f"step has {job.nnodes}: ask sbatch/srun for {low} or more nodes "
                    f"(--nodes), or lower --nnodes")
    if job.nnodes > high:
        return f" ({job.nnodes - high} spare node(s) wait beyond --nnodes {nnodes})", None
    return "", None

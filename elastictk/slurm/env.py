"""What Slurm tells a task about its job, read from the variables ``srun`` sets.

Under ``srun`` (``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` both set) :func:`read` returns a
:class:`SlurmJob`; elsewhere None, and nothing of Slurm is used. The variables are input from
outside the process: a malformed one is a :class:`SlurmEnvError` naming the variable, its
value and what Slurm writes there, never a guess.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

from .nodelist import NodelistError, expand, scontrol_hostnames

_ID = re.compile(r"[0-9]{1,20}")
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


class SlurmEnvError(ValueError):
    """A Slurm variable that is not what Slurm writes; ``str()`` is one line."""


@dataclass(frozen=True)
class SlurmJob:
    """The job step this task runs in, as Slurm describes it."""

    job_id: str
    step_id: str
    nnodes: int  # nodes in the step (SLURM_NNODES, else SLURM_JOB_NUM_NODES)
    hosts: tuple[str, ...]  # the node list, expanded
    nodelist_var: str  # which variable the list came from
    node_name: str | None  # SLURMD_NODENAME: this node's Slurm name
    procid: int | None  # SLURM_PROCID: this task's rank in the step
    localid: int | None  # SLURM_LOCALID: this task's index on its node
    restart_count: int  # SLURM_RESTART_COUNT: times the job was requeued (0 first)
    expanded_by: str  # "scontrol" or "parser"
    disagreement: str | None = None  # scontrol and the parser differed: one line saying how

    @property
    def first_host(self) -> str:
        return self.hosts[0]


#: Steps Slurm names that are not an srun step: a batch script, the extern step, salloc's shell.
NOT_SRUN_STEPS = ("batch", "extern", "interactive")


def under_srun(env: Mapping[str, str]) -> bool:
    """Whether this process is a task of an ``srun`` step."""
    return bool(env.get("SLURM_JOB_ID")) and bool(env.get("SLURM_STEP_ID")) and \
        env.get("SLURM_STEP_ID", "").strip() not in NOT_SRUN_STEPS


def outside_srun(env: Mapping[str, str]) -> str | None:
    """The line for an ``elastictk-run`` started in a Slurm job but not by ``srun`` (in the batch
    script itself, or salloc's shell): it runs on this one host and takes nothing from the job,
    which is not what a script written for the job's nodes means. None in an srun step or outside
    Slurm."""
    if not env.get("SLURM_JOB_ID") or under_srun(env):
        return None
    nodes = (env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "").strip()
    many = f"its {nodes} nodes" if nodes.isdigit() else "its nodes"
    return (f"in Slurm job {env['SLURM_JOB_ID'].strip()[:20]} but not started by srun (no srun step: "
            "a batch script runs on the job's first node only), so no Slurm default is taken and "
            f"this is one node here; to train on {many}, start it as `srun ... elastictk-run ...` "
            "(one task per node, as examples/slurm/train.sbatch does)")


def read(env: Mapping[str, str],
         hostnames: Callable[[str], list[str] | None] = scontrol_hostnames) -> SlurmJob | None:
    """The Slurm job step of this task, or None outside ``srun``. ``hostnames``: Slurm's own
    expansion of a node list (``scontrol show hostnames``), used when it answers; the parser's
    is checked against it."""
    if not under_srun(env):
        return None
    job_id = _id(env, "SLURM_JOB_ID")
    step_id = _step(env)
    nodes_var = "SLURM_NNODES" if env.get("SLURM_NNODES") else "SLURM_JOB_NUM_NODES"
    nnodes = _count(env, nodes_var, minimum=1)
    list_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                     if env.get(v)), None)
    if list_var is None:
        raise SlurmEnvError("SLURM_JOB_ID is set but SLURM_JOB_NODELIST is not: the rendezvous "
                            "host is its first node; run under srun, or give --rdzv-endpoint")
    text = env[list_var]
    try:
        parsed = expand(text)
    except NodelistError as e:
        raise SlurmEnvError(f"{list_var}: {e}; Slurm writes lists like node[01-03,07]") from None
    hosts, by, disagreement = parsed, "parser", None
    official = hostnames(text)
    if official is not None:
        if official != parsed:
            disagreement = (f"scontrol show hostnames expands {list_var} to {len(official)} host(s) "
                            f"starting {official[0]!r}, elastictk's parser to {len(parsed)} starting "
                            f"{parsed[0]!r}; using scontrol's")
        hosts, by = official, "scontrol"
    for h in hosts[:1]:
        if not _HOST.fullmatch(h):
            raise SlurmEnvError(f"{list_var}: first host {h!r} is not a host name")
    node = env.get("SLURMD_NODENAME") or None
    if node is not None and not _HOST.fullmatch(node):
        raise SlurmEnvError(f"SLURMD_NODENAME={node!r} is not a host name")
    return SlurmJob(
        job_id=job_id, step_id=step_id, nnodes=nnodes, hosts=tuple(hosts), nodelist_var=list_var,
        node_name=node, procid=_opt_count(env, "SLURM_PROCID"), localid=_opt_count(env, "SLURM_LOCALID"),
        restart_count=_opt_count(env, "SLURM_RESTART_COUNT") or 0, expanded_by=by,
        disagreement=disagreement,
    )


def _id(env: Mapping[str, str], name: str) -> str:
    raw = env[name].strip()
    if not _ID.fullmatch(raw):
        raise SlurmEnvError(f"{name}={env[name]!r} is not a Slurm job id (digits); unset it "
                            "outside Slurm, or give --rdzv-id")
    return raw


def _step(env: Mapping[str, str]) -> str:
    """SLURM_STEP_ID: a number, or one of Slurm's named steps (batch, extern, interactive)."""
    raw = env["SLURM_STEP_ID"].strip()
    if _ID.fullmatch(raw) or raw in ("batch", "extern", "interactive"):
        return raw
    raise SlurmEnvError(f"SLURM_STEP_ID={env['SLURM_STEP_ID']!r} is not a Slurm step id; "
                        "unset it outside srun")


def _count(env: Mapping[str, str], name: str, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or not raw.strip():
        raise SlurmEnvError("SLURM_JOB_ID is set but neither SLURM_NNODES nor SLURM_JOB_NUM_NODES "
                            "is: run under srun, or give --nnodes")
    value = _opt_count(env, name)
    if value is None or value < minimum:
        raise SlurmEnvError(f"{name}={raw!r} is not a node count (a whole number, at least {minimum})")
    return value


def _opt_count(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    if not _ID.fullmatch(raw.strip()):
        raise SlurmEnvError(f"{name}={raw!r} is not a whole number; Slurm sets it to one")
    return int(raw.strip())

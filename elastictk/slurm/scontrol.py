"""The two things a job asks of Slurm: requeue itself after a pre-emption, drain a bad node.

Each is one ``scontrol`` call with a deadline. Neither may stop the job or the launcher's exit:
a missing ``scontrol``, a refusal (a user may not drain nodes; a job submitted with
``--no-requeue`` cannot be requeued) or a hang comes back as one line saying what happened and
what to do, for the caller to log.

What reaches ``scontrol``'s argv is checked first, whoever calls: a job id is digits (never a
list such as ``4242,4243``), a node is one host name of this job's node list and never a Slurm
keyword (``NodeName=ALL`` means every node of the cluster) nor a hostlist expression
(``node[1-500]``). :func:`job_id` and :func:`this_node` read them from the environment with
those checks, inside a job step and outside one (an sbatch batch step has ``SLURM_JOB_ID`` and
no ``SLURM_STEP_ID``): ``elastictk-run`` refuses bad ones at start (exit 2) and asks nothing.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping

from .env import SlurmEnvError
from .nodelist import NodelistError, expand

TIMEOUT = 20.0
#: What a drain reason may hold: Slurm stores it as text, and it reaches ``scontrol``'s argv,
#: so no quotes, newlines or control characters.
_REASON_DROP = re.compile(r"[^A-Za-z0-9 ._,:;/()+=@%-]")
_JOB_ID = re.compile(r"[1-9][0-9]{0,19}")
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
#: Names ``scontrol update NodeName=`` (or slurm.conf) reads as a keyword, not as one node.
KEYWORDS = frozenset({"all", "default"})
#: Where Slurm lists the job's nodes (the whole allocation, not only this step's).
NODELIST_VARS = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")


@dataclass(frozen=True)
class Answer:
    """How one ``scontrol`` call went: ``ok``, and one line for the log."""

    ok: bool
    line: str


def _run(args: list[str], what: str, fix: str) -> Answer:
    exe = shutil.which("scontrol")
    if exe is None:
        return Answer(False, f"cannot {what}: scontrol is not on PATH ({fix})")
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=TIMEOUT,
                              check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Answer(False, f"cannot {what}: scontrol {args[0]} did not answer within {TIMEOUT:g}s ({fix})")
    except OSError as e:
        return Answer(False, f"cannot {what}: scontrol did not start ({e.strerror}) ({fix})")
    if done.returncode != 0:
        said = " ".join((done.stderr or done.stdout).split())[:300] or f"exit {done.returncode}"
        return Answer(False, f"cannot {what}: scontrol {args[0]} said: {said} ({fix})")
    return Answer(True, f"asked Slurm to {what}: scontrol {' '.join(args)}")


def job_id(env: Mapping[str, str]) -> str:
    """``SLURM_JOB_ID``, checked to be one job id; else :class:`SlurmEnvError` (one line)."""
    raw = env.get("SLURM_JOB_ID", "")
    if not _JOB_ID.fullmatch(raw):
        raise SlurmEnvError(f"SLURM_JOB_ID={raw[:80]!r} is not one Slurm job id (digits), so "
                            "scontrol is not asked; run under Slurm's own environment or unset it")
    return raw


def this_node(env: Mapping[str, str]) -> str:
    """``SLURMD_NODENAME``, checked to be one host name of this job's node list and not a Slurm
    keyword; else :class:`SlurmEnvError` (one line)."""
    raw = env.get("SLURMD_NODENAME", "")
    bad = _bad_node(raw)
    if bad is not None:
        raise SlurmEnvError(f"SLURMD_NODENAME={raw[:80]!r} {bad}, so scontrol is not asked to "
                            "drain it; run under Slurm's own environment")
    var = next((v for v in NODELIST_VARS if env.get(v)), None)
    if var is None:
        raise SlurmEnvError(f"SLURMD_NODENAME={raw!r} cannot be checked against the job's nodes: "
                            "SLURM_JOB_NODELIST is not set; run under Slurm's own environment")
    try:
        hosts = expand(env[var])
    except NodelistError as e:
        raise SlurmEnvError(f"{var}: {e}; Slurm writes lists like node[01-03,07]") from None
    if raw not in hosts:
        raise SlurmEnvError(f"SLURMD_NODENAME={raw!r} is not a node of this job ({var}="
                            f"{env[var][:80]!r}), so scontrol is not asked to drain it; run "
                            "under Slurm's own environment")
    return raw


def _bad_node(node: str) -> str | None:
    """Why ``node`` may not follow ``NodeName=``, or None."""
    if not _HOST.fullmatch(node):
        return "is not one host name"
    if node.lower() in KEYWORDS:
        return f"is Slurm's keyword {node!r} (it names more than this node)"
    return None


def requeue(job_id: str) -> Answer:
    """``scontrol requeue JOB``: the job goes back to the queue and runs again. Anything but
    one job id is refused here, unasked."""
    if not _JOB_ID.fullmatch(job_id):
        return Answer(False, f"not asking Slurm to requeue job {job_id[:80]!r}: not one job id "
                             "(digits); requeue it by hand")
    return _run(["requeue", job_id], f"requeue job {job_id}",
                "requeue it by hand, or submit it again; sbatch --requeue allows requeues")


def drain_reason(text: str) -> str:
    """``elastictk: <text>``, with what Slurm's reason field should not hold dropped, at most
    200 characters."""
    return ("elastictk: " + _REASON_DROP.sub("", " ".join(text.split())))[:200]


def drain(node: str, reason: str) -> Answer:
    """``scontrol update NodeName=NODE State=DRAIN Reason="elastictk: ..."``. A ``node`` that
    is not one host name (a keyword, a hostlist) is refused here, unasked."""
    bad = _bad_node(node)
    if bad is not None:
        return Answer(False, f"not asking Slurm to drain {node[:80]!r}: it {bad}; drain the node "
                             "by hand if it is bad")
    return _run(["update", f"NodeName={node}", "State=DRAIN", f"Reason={drain_reason(reason)}"],
                f"drain node {node}",
                "draining needs Slurm operator rights; ask an administrator to drain it")

"""The two things a job asks of Slurm: requeue itself after a pre-emption, drain a bad node.

Each is one ``scontrol`` call with a deadline. Neither may stop the job or the launcher's exit:
a missing ``scontrol``, a refusal (a user may not drain nodes; a job submitted with
``--no-requeue`` cannot be requeued) or a hang comes back as one line saying what happened and
what to do, for the caller to log.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

TIMEOUT = 20.0
#: What a drain reason may hold: Slurm stores it as text, and it reaches ``scontrol``'s argv,
#: so no quotes, newlines or control characters.
_REASON_DROP = re.compile(r"[^A-Za-z0-9 ._,:;/()+=@%-]")


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


def requeue(job_id: str) -> Answer:
    """``scontrol requeue JOB``: the job goes back to the queue and runs again."""
    return _run(["requeue", job_id], f"requeue job {job_id}",
                "requeue it by hand, or submit it again; sbatch --requeue allows requeues")


def drain_reason(text: str) -> str:
    """``elastictk: <text>``, with what Slurm's reason field should not hold dropped, at most
    200 characters."""
    return ("elastictk: " + _REASON_DROP.sub("", " ".join(text.split())))[:200]


def drain(node: str, reason: str) -> Answer:
    """``scontrol update NodeName=NODE State=DRAIN Reason="elastictk: ..."``."""
    return _run(["update", f"NodeName={node}", "State=DRAIN", f"Reason={drain_reason(reason)}"],
                f"drain node {node}",
                "draining needs Slurm operator rights; ask an administrator to drain it")

"""The exception a launcher raises when its job failed: torch's ``ChildFailedError``, so code
that wraps ``torch.distributed.run.main`` in ``try/except`` (Lightning, Accelerate, schedulers'
launch shims, test suites) catches elastictk's failures the same way.

Its ``failures`` map global ranks to torch's own ``ProcessFailure`` records (with the error
file each worker wrote, so ``get_first_failure`` and an error-file-reading scheduler work as
with torchrun); its message is elastictk's root-cause report instead of torch's table, and
``result`` keeps the whole :class:`AgentResult`. Imports torch: load it only on failure.
"""
from __future__ import annotations

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure as TorchFailure

from ..supervisor.report import ProcessFailure
from ..supervisor.report_text import render_text
from .outcome import AgentResult


def torch_failure(f: ProcessFailure) -> TorchFailure:
    """torch's record of one failed worker (exit code negative for a signal, as torch has it)."""
    code = -f.signal if f.signal else (f.exitcode if f.exitcode is not None else 1)
    return TorchFailure(local_rank=f.local_rank, pid=f.pid, exitcode=code,
                        error_file=f.error_file or "")


class WorkersFailed(ChildFailedError):
    """The job failed: this node's failed workers (empty when the first failure was on
    another node, or no worker failed: a lost store, a refused rendezvous), and why."""

    def __init__(self, name: str, result: AgentResult) -> None:
        self.name = name
        self.result = result
        report = result.report
        self.failures = {} if report is None else {
            f.rank: torch_failure(f) for f in report.failures}
        text = render_text(report) if report is not None else ""
        Exception.__init__(self, f"{name} failed: {result.message}" + (f"\n{text}" if text else ""))

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        return str(self.args[0])

"""Deprecated: split into :mod:`elastictk.lifetime.procfs` and :mod:`elastictk.lifetime.handle`
(this path works for one more release)."""
from elastictk._moved import warn_moved

from ..lifetime.handle import ProcessHandle
from ..lifetime.procfs import ProcStat, in_tree, read_stat, signal_state, start_time

warn_moved(__name__, "elastictk.lifetime.procfs and elastictk.lifetime.handle")

__all__ = ["ProcStat", "ProcessHandle", "in_tree", "read_stat", "signal_state", "start_time"]

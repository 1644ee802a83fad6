"""Deprecated: moved to :mod:`elastictk.lifetime.reaper` (this path works for one more release)."""
from elastictk._moved import redirect

redirect(__name__, "elastictk.lifetime.reaper")

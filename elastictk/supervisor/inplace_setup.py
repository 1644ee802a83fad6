"""Deprecated: moved to :mod:`elastictk.agent.inplace_host` (this path works for one more release)."""
from elastictk._moved import redirect

redirect(__name__, "elastictk.agent.inplace_host")

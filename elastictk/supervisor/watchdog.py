"""Deprecated: moved to :mod:`elastictk.agent.watchdog` (this path works for one more release)."""
from elastictk._moved import redirect

redirect(__name__, "elastictk.agent.watchdog")

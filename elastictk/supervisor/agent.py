"""Deprecated: moved to :mod:`elastictk.agent.elastic` (this path works for one more release)."""
from elastictk._moved import redirect

redirect(__name__, "elastictk.agent.elastic")

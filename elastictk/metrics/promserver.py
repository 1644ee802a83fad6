"""Deprecated: moved to :mod:`elastictk.testing.prometheus` (this path works for one more release)."""
from elastictk._moved import redirect

redirect(__name__, "elastictk.testing.prometheus")

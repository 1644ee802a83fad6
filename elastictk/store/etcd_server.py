"""Deprecated: moved to :mod:`elastictk.testing.etcd` (this path works for one more release)."""
from elastictk._moved import redirect

redirect(__name__, "elastictk.testing.etcd")

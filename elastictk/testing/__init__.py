"""elastictk.testing: real daemons for tests and demos, importable by users' own tests.

:class:`EtcdServer`/:class:`EtcdCluster` start local etcd members and :class:`PrometheusServer` a
local Prometheus that scrapes an exporter. Each binds loopback only, owns a temp dir, and dies
with the thread that started it (``PR_SET_PDEATHSIG``), so a SIGKILLed test run leaves nothing.
"""
from __future__ import annotations

from .etcd import EtcdNotInstalled, EtcdServer, EtcdStartError, find_etcd
from .etcdcluster import EtcdCluster
from .prometheus import PrometheusError, PrometheusNotInstalled, PrometheusServer, find_prometheus

__all__ = [
    "EtcdCluster", "EtcdNotInstalled", "EtcdServer", "EtcdStartError", "PrometheusError",
    "PrometheusNotInstalled", "PrometheusServer", "find_etcd", "find_prometheus",
]

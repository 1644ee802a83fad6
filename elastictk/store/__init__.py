"""Key-value stores behind one interface: file, torch c10d TCPStore, etcd v3."""
from .base import (
    DEFAULT_TIMEOUT,
    Deadline,
    Store,
    StoreClosed,
    StoreError,
    StoreTimeout,
    StoreUnreachable,
)
from .endpoint import Endpoint, EndpointError, free_port, parse_endpoint, port_in_use
from .etcd import EtcdStore
from .etcd_server import EtcdServer
from .file import FileStore
from .prefix import PrefixStore

__all__ = [
    "DEFAULT_TIMEOUT", "Deadline", "Endpoint", "EndpointError", "EtcdServer", "EtcdStore",
    "FileStore", "PrefixStore", "Store", "StoreClosed", "StoreError", "StoreTimeout",
    "StoreUnreachable", "TCPStore", "free_port", "parse_endpoint", "port_in_use",
]


def __getattr__(name: str):  # torch-backed stores import torch lazily
    if name == "TCPStore":
        from .tcp import TCPStore

        return TCPStore
    raise AttributeError(name)

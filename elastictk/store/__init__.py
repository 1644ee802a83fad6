"""Key-value stores behind one interface: file, torch c10d TCPStore, etcd v3."""
from typing import TYPE_CHECKING

from .base import (
    DEFAULT_TIMEOUT,
    Deadline,
    Store,
    StoreClosed,
    StoreError,
    StoreTimeout,
    StoreUnreachable,
)
from .endpoint import Endpoint, EndpointError, free_port, parse_endpoint, port_in_use, quiet_port
from .etcd import EtcdStore
from .file import FileStore
from .prefix import PrefixStore
from .wait import wait_for_store

if TYPE_CHECKING:
    from .tcp import TCPStore

__all__ = [
    "DEFAULT_TIMEOUT", "Deadline", "Endpoint", "EndpointError", "EtcdStore",
    "FileStore", "PrefixStore", "Store", "StoreClosed", "StoreError", "StoreTimeout",
    "StoreUnreachable", "TCPStore", "free_port", "parse_endpoint", "port_in_use", "quiet_port",
    "wait_for_store",
]


def __getattr__(name: str) -> object:
    if name == "TCPStore":  # torch-backed stores import torch lazily
        from .tcp import TCPStore

        return TCPStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

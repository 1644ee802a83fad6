"""Checks of paths and host names against this machine, before anything starts: the paths
by :func:`~elastictk.cli.config.check_system`, the host names by ``elastictk-run`` just before
it opens the store (a config built for another host may name hosts only that one resolves).

Each one turns a failure that would otherwise come later (a traceback from the agent when the
log directory cannot be made, an event log that fails with "File exists", a c10d client that
waits a minute on a name no resolver knows) into one line naming the flag, exit 2.
"""
from __future__ import annotations

import os
import socket
import tempfile
from typing import Protocol

from ..store.endpoint import Endpoint
from .values import UsageError


class Where(Protocol):
    """What of a :class:`~elastictk.cli.config.LaunchConfig` says where the store is (a
    protocol, so that config.py may import this module)."""

    @property
    def rdzv_backend(self) -> str: ...
    @property
    def rdzv_endpoint(self) -> Endpoint | None: ...
    @property
    def rdzv_endpoints(self) -> tuple[Endpoint, ...]: ...
    @property
    def master_addr(self) -> str: ...
    @property
    def master_port(self) -> int: ...
    @property
    def standalone(self) -> bool: ...


def check_writable_dir(path: str, flag: str, named: str | None = None) -> None:
    """``path`` is a directory this process can create files in, or can be created: its
    nearest existing ancestor is a directory where a directory can be made. A real probe (a
    directory made and removed there), because permission bits do not tell: root passes
    ``os.access`` on /proc and on read-only mounts, where every ``mkdir`` fails. ``named``:
    how the line names the input (default ``flag path``)."""
    at = named or f"{flag} {path}"
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{at}: is a file, not a directory; pick a directory")
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"{at}: {probe} is a file, so no directory can be made "
                         "under it; pick a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "" if probe == os.path.abspath(path) else f" {probe}, where it would be made,"
        raise UsageError(f"{at}: the directory{where} is not writable by this user; "
                         "pick a writable directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".elastictk-probe-", dir=probe))
    except OSError as e:
        raise UsageError(f"{at}: cannot create a directory in {probe} "
                         f"({e.strerror or e}); pick a writable directory") from None


def check_event_log(path: str) -> None:
    """``--event-log PATH`` names a file (existing or not) in a directory that exists or can be
    made; the log itself is opened when the agent starts."""
    if os.path.isdir(path):
        raise UsageError(f"--event-log {path}: is a directory; give a file path, e.g. "
                         f"{os.path.join(path, 'events.jsonl')}")
    probe = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"--event-log {path}: {probe} is a file, so the log cannot be made "
                         "under it; give a path in a directory")
    check_writable_dir(os.path.dirname(os.path.abspath(path)), "--event-log",
                       named=f"--event-log {path}")


def endpoint_flag(config: Where) -> str:
    """The flag(s) the rendezvous endpoint came from, as an error line should name them."""
    ep = config.rdzv_endpoint
    if (config.rdzv_backend == "static" and ep is not None
            and (ep.host, ep.port) == (config.master_addr, config.master_port)):
        return "--master-addr/--master-port"
    return "--rdzv-endpoint"


def check_endpoint_hosts(config: Where) -> None:
    """Every rendezvous host name resolves. Without this an unknown name fails later and
    worse: a c10d host told ``is_host=true`` waits out torch's connect timeout (a minute) and
    prints a C++ log line; a client fails after the store's own retries."""
    if config.standalone or config.rdzv_backend == "file":
        return
    members = config.rdzv_endpoints or ((config.rdzv_endpoint,) if config.rdzv_endpoint else ())
    for ep in members:
        problem = _resolve_problem(ep)
        if problem is None:
            continue
        if endpoint_flag(config) == "--master-addr/--master-port":
            where = f"--master-addr {ep.host}"
        else:
            where = f"--rdzv-endpoint {config.rdzv_endpoint if len(members) == 1 else ep}"
        raise UsageError(f"{where}: cannot resolve host {ep.host} ({problem}); check the name, "
                         "or give the address of the node that hosts the store")


def _resolve_problem(ep: Endpoint) -> str | None:
    try:
        socket.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:  # the store's own connect would fail on it too
        return e.strerror or str(e)
    except UnicodeError as e:  # a label too long for IDNA
        return str(e)
    return None

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
import stat
import tempfile
from typing import Protocol

from .._paths import Unsafe, check_file_dir, dir_problem, open_append, private_subdir_fix, shared_sticky
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
    @property
    def local_addr(self) -> str | None: ...


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


def shared_dir_first_fix(path: str, flag: str) -> None:
    """A sticky directory every user may write in (``/tmp``, mode 1777) named where elastictk needs one
    only this user can write: the fix offered first is a private subdirectory of it (created
    mode 0700), never making the shared directory unwritable for everyone else."""
    try:
        st = os.stat(path)
    except OSError:
        return
    # Sticky only: in a directory others may write without the sticky bit they could rename a
    # private subdirectory away, so there the fix stays the general rule's (chmod go-w, or a
    # directory of one's own; elastictk/_paths.py says it).
    if not stat.S_ISDIR(st.st_mode) or not shared_sticky(st.st_mode):
        return
    raise UsageError(f"{flag} {path}: every user can write in {path} (mode "
                     f"{stat.S_IMODE(st.st_mode):04o}), and this needs a directory only you can "
                     f"write; give {private_subdir_fix(path, flag)}")


#: First words ``sh`` runs itself (builtins, keywords): what they do is the shell's to judge.
SHELL_WORDS = frozenset(
    "! . : [ [[ alias break case cd command continue echo eval exec exit export false for if "
    "kill local printf pwd read return set shift source test times trap true type ulimit umask "
    "unset until wait while { (".split())


def check_health_command(command: str) -> None:
    """``--health-check``'s program exists and is executable: a missing one exits 127 (126 not
    executable) at every check, which kept the node out of its job forever, counted as a bad
    node. Judged on the command's first word as ``sh`` finds it (PATH, or a path); a command
    that starts with shell syntax (a builtin, ``VAR=x``, ``$(...)``) is left to the shell."""
    import shlex
    import shutil

    try:
        words = shlex.split(command)
    except ValueError as e:
        raise UsageError(f"--health-check {command!r}: not a shell command ({e}); quote it as "
                         "one argument, e.g. --health-check 'nvidia-smi -L'") from None
    first = words[0] if words else ""
    if not first or first in SHELL_WORDS or any(ch in first for ch in "$`(){}=;|&<>*?~"):
        return
    if "/" not in first:
        if shutil.which(first) is None:
            raise UsageError(f"--health-check {command!r}: {first} is not on PATH (the shell would "
                             "exit 127 at every check, and the node would never join); give the "
                             "program's full path or install it")
        return
    if not os.path.isfile(first):
        raise UsageError(f"--health-check {command!r}: {first} does not exist (the shell would exit "
                         "127 at every check, and the node would never join); give the right path")
    if not os.access(first, os.X_OK):
        raise UsageError(f"--health-check {command!r}: {first} is not executable (the shell would "
                         f"exit 126 at every check); run chmod +x {first}, or start it with sh")


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
    parent = os.path.dirname(os.path.abspath(path))
    check_writable_dir(parent, "--event-log", named=f"--event-log {path}")
    # The agent (maybe root) appends to it: a directory another user made or can write, a
    # symlink planted there, another user's file are refused (_paths), never followed.
    try:
        if os.path.isdir(parent):
            check_file_dir(parent, "directory for the event log")
        if os.path.lexists(path):
            os.close(open_append(path))
    except Unsafe as e:
        raise UsageError(f"--event-log {path}: {e}") from None
    except OSError as e:
        raise UsageError(f"--event-log {path}: cannot open it ({e.strerror or e}); give a "
                         "file path you can write") from None


def check_log_dir(path: str) -> None:
    """``--log-dir``: writable (or can be made), and, when it exists, this user's and not
    writable by others: whoever can write it can rename a run's directory away or plant
    links where the agent writes logs."""
    check_writable_dir(path, "--log-dir")
    if os.path.isdir(path):
        problem = dir_problem(path, "log directory")
        if problem is not None:
            raise UsageError(f"--log-dir {path}: {problem}")


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
    _check_local_addr(config.local_addr)
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


def _check_local_addr(addr: str | None) -> None:
    """``--local-addr`` is an address or a name that resolves: a host that hosts the store
    binds it (an unknown one spent torch's 30 s connect timeout, then blamed the port)."""
    if addr is None:
        return
    labels = addr.split(".")
    if len(labels) == 4 and all(x.isdigit() for x in labels) and any(int(x) > 255 for x in labels):
        raise UsageError(f"--local-addr {addr}: not an IPv4 address (each of its four numbers is "
                         "0-255); give this node's address or host name as its peers reach it")
    problem = _resolve_problem(Endpoint(addr, 0))
    if problem is not None:
        raise UsageError(f"--local-addr {addr}: cannot resolve host {addr} ({problem}); give this "
                         "node's address or host name as its peers reach it")


def _resolve_problem(ep: Endpoint) -> str | None:
    try:
        socket.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:  # the store's own connect would fail on it too
        return e.strerror or str(e)
    except UnicodeError as e:  # a label too long for IDNA
        return str(e)
    return None

"""Host/port parsing shared by the stores and the CLI, so every flag reads endpoints the same way.

Accepted forms: ``host``, ``host:port``, ``[v6addr]``, ``[v6addr]:port``; a bare IPv6 address
without brackets is accepted only when it cannot be confused with ``host:port``.
"""
from __future__ import annotations

import ipaddress
import random
import re
import socket
from dataclasses import dataclass
from pathlib import Path

_HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9\-_.]*[A-Za-z0-9])?$")


class EndpointError(ValueError):
    """A malformed endpoint; the message names it and shows the accepted forms."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _bad(text: str, why: str) -> EndpointError:
    return EndpointError(
        f"invalid endpoint {text!r}: {why}; use host, host:port or [ipv6]:port "
        "(e.g. 127.0.0.1:29400)"
    )


def _check_port(text: str, port_text: str) -> int:
    if not port_text.isdigit():
        raise _bad(text, f"port {port_text!r} is not a number")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise _bad(text, f"port {port} is out of range 0-65535")
    return port


def _check_host(text: str, host: str) -> str:
    if not host:
        raise _bad(text, "the host is empty")
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if not _HOST_RE.match(host):
        raise _bad(text, f"host {host!r} is not a valid hostname or IP address")
    return host


def parse_endpoint(text: str, default_port: int | None = None) -> Endpoint:
    """Parse ``text`` into an :class:`Endpoint`; a missing port takes ``default_port``."""
    raw = text.strip()
    if not raw:
        raise _bad(text, "it is empty")
    if "://" in raw:
        raise _bad(text, "leave out the scheme (drop everything up to '://')")
    port_text: str | None = None
    if raw.startswith("["):
        end = raw.find("]")
        if end < 0:
            raise _bad(text, "missing ']' after the IPv6 address")
        host, rest = raw[1:end], raw[end + 1 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _bad(text, f"{host!r} is not an IPv6 address") from None
        if rest:
            if not rest.startswith(":"):
                raise _bad(text, f"unexpected {rest!r} after ']'")
            port_text = rest[1:]
    elif raw.count(":") > 1:
        try:
            ipaddress.IPv6Address(raw)
        except ValueError:
            raise _bad(text, "an IPv6 address with a port must be bracketed") from None
        host = raw
    elif ":" in raw:
        host, port_text = raw.rsplit(":", 1)
        host = _check_host(text, host)
    else:
        host = _check_host(text, raw)
    if port_text is not None:
        port = _check_port(text, port_text)
    elif default_port is not None:
        port = default_port
    else:
        raise _bad(text, "no port given")
    return Endpoint(host, port)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago; prefer binding to port 0 where the API allows it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# etcd's client and peer ports and torch's c10d and MASTER_PORT defaults: a job may ask for them
# by name, so a port picked for another is never one of them.
_DEFAULT_PORTS = frozenset({2379, 2380, 29400, 29500})
_QUIET_FLOOR = 20000
_rng = random.SystemRandom()  # not the random module's state, which tests may seed


def quiet_port(host: str = "127.0.0.1") -> int:
    """A free port below the kernel's ephemeral range, for a server a child process binds later.

    :func:`free_port`'s port comes from that range, where every ``bind(("", 0))`` and outgoing
    ``connect`` of the machine draws its own: between the pick and the child's bind (an
    interpreter start, seconds on a loaded host) another process can take it, and the child
    finds a stranger there (a test suite's many servers did it). Below the range only another
    explicit pick can, one chance in thousands. Falls back to :func:`free_port` where the range
    cannot be read or leaves no room below it."""
    low = _ephemeral_low()
    if low is None or low - _QUIET_FLOOR < 1000:
        return free_port(host)
    for _ in range(64):
        port = _rng.randrange(_QUIET_FLOOR, low)
        if port not in _DEFAULT_PORTS and not port_in_use(host, port):
            return port
    return free_port(host)


def _ephemeral_low() -> int | None:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return low if 1024 < low <= 65535 else None


def port_in_use(host: str, port: int) -> bool:
    """Whether something is already listening on ``host:port``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def connect(endpoint: Endpoint, timeout: float) -> socket.socket | str:
    """One TCP connect: the connected socket (the caller's to close), else a short reason
    for an error line (``connection refused``, a timeout, an unresolvable host...)."""
    try:
        return socket.create_connection((endpoint.host, endpoint.port), timeout=max(timeout, 0.01))
    except ConnectionRefusedError:
        return "connection refused (nothing listens there)"
    except socket.timeout:
        return f"no answer within {timeout:g}s"
    except socket.gaierror as e:
        return f"cannot resolve host ({e.strerror})"
    except OSError as e:
        return e.strerror or str(e)

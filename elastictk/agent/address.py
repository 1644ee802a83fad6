"""Which address an agent gives its peers: the one its route to the rendezvous store uses."""
from __future__ import annotations

import socket


def is_ip(text: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in text else socket.AF_INET, text)
        return True
    except OSError:
        return False


def local_address(store_endpoint: str | None) -> str:
    """The address peers can reach this node at: the one it uses to reach the store.

    Hostnames do not resolve in every cluster (or test network namespace); the source address
    of a route to the rendezvous endpoint does, when there is one.
    """
    from ..store import parse_endpoint

    for text in (store_endpoint or "").split(","):  # etcd: a list of members
        try:
            ep = parse_endpoint(text.strip(), 1)
            family = socket.AF_INET6 if ":" in ep.host else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((ep.host, ep.port or 1))
                return str(s.getsockname()[0])
        except (OSError, ValueError):
            continue
    return socket.getfqdn()

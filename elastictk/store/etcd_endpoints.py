"""Where etcd is and how to talk to it securely: endpoint lists with their scheme, and TLS.

Apart from :mod:`elastictk.store.etcd` because it is configuration, checked before any
connection is made (the CLI validates ``--rdzv-endpoint`` and ``--rdzv-conf`` cacert/cert/key
with it), while the store module is the protocol over an open connection. Every problem is one
:class:`~elastictk.store.base.StoreError` or :class:`EndpointError` line naming the fix.
"""
from __future__ import annotations

import os
import ssl
from typing import Sequence

from .base import StoreError
from .endpoint import Endpoint, EndpointError, parse_endpoint

ETCD_DEFAULT_PORT = 2379

SCHEMES = ("http", "https")


def split_scheme(text: str) -> tuple[str | None, str]:
    """``"https://h:1"`` -> ``("https", "h:1")``; no scheme -> ``(None, text)``."""
    raw = text.strip()
    scheme, sep, rest = raw.partition("://")
    if not sep:
        return None, raw
    if scheme.lower() not in SCHEMES:
        raise EndpointError(
            f"invalid etcd endpoint {raw!r}: scheme {scheme!r} is not http or https; use "
            "host:port, http://host:port or https://host:port"
        )
    return scheme.lower(), rest.rstrip("/")


def parse_endpoints_and_scheme(
    endpoints: str | Endpoint | Sequence[str | Endpoint],
) -> tuple[list[Endpoint], str | None]:
    """The endpoints and the one scheme they were written with (``None``: none written)."""
    items = endpoints.split(",") if isinstance(endpoints, str) else (
        [endpoints] if isinstance(endpoints, Endpoint) else list(endpoints)
    )
    out: list[Endpoint] = []
    schemes: set[str] = set()
    for e in items:
        if isinstance(e, Endpoint):
            out.append(e)
            continue
        scheme, rest = split_scheme(e)
        if scheme is not None:
            schemes.add(scheme)
        out.append(parse_endpoint(rest, ETCD_DEFAULT_PORT))
    if not out:
        raise EndpointError("no etcd endpoint given; pass host:port (e.g. 127.0.0.1:2379)")
    if len(schemes) > 1:
        raise EndpointError(
            "etcd endpoints mix http:// and https://; every member of one cluster is reached "
            "the same way: write them all with the same scheme"
        )
    return out, (schemes.pop() if schemes else None)


def parse_endpoints(endpoints: str | Endpoint | Sequence[str | Endpoint]) -> list[Endpoint]:
    """``"h1:2379,h2:2379"`` or a list of them; a missing port means 2379 (``http://``/
    ``https://`` allowed, see :func:`parse_endpoints_and_scheme`)."""
    return parse_endpoints_and_scheme(endpoints)[0]


def _readable(what: str, path: str | os.PathLike[str]) -> str:
    """``path`` as text if it is a readable file, else a one-line :class:`StoreError`."""
    text = os.fspath(path)
    try:
        with open(text, "rb") as f:
            f.read(1)
    except FileNotFoundError:
        raise StoreError(f"{what} file {text} does not exist; give the path of a PEM file") from None
    except IsADirectoryError:
        raise StoreError(f"{what} file {text} is a directory; give the path of a PEM file") from None
    except PermissionError:
        raise StoreError(
            f"{what} file {text} is not readable by this user; fix its permissions (chmod/chown)"
        ) from None
    except OSError as e:
        raise StoreError(f"{what} file {text} cannot be read ({e.strerror or e})") from None
    return text


def tls_context(
    cacert: str | os.PathLike[str] | None = None,
    cert: str | os.PathLike[str] | None = None,
    key: str | os.PathLike[str] | None = None,
) -> ssl.SSLContext:
    """A client context for etcd over TLS: verify etcd against ``cacert`` (the system CAs when
    ``None``) and present ``cert``/``key`` (``key`` may be left out when ``cert`` holds it).

    Every problem with the files is one :class:`StoreError` line naming the file and the fix.
    """
    if key is not None and cert is None:
        raise StoreError("a client key was given without its certificate: set cert= too")
    ca = _readable("cacert (CA certificate)", cacert) if cacert is not None else None
    crt = _readable("cert (client certificate)", cert) if cert is not None else None
    k = _readable("key (client private key)", key) if key is not None else None
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except (ssl.SSLError, ValueError) as e:
        raise StoreError(
            f"cacert file {ca} holds no usable CA certificate ({getattr(e, 'reason', None) or e}); "
            "give the PEM certificate of the CA that signed etcd's certificate"
        ) from None
    setattr(ctx, "_elastictk_client_cert", crt)  # named when etcd refuses it (etcd_http.explain)
    if crt is not None:
        try:
            ctx.load_cert_chain(crt, k)
        except ssl.SSLError as e:
            why = getattr(e, "reason", None) or str(e)
            raise StoreError(
                f"cannot use client certificate {crt} with key {k or crt} ({why}); give the PEM "
                "certificate as cert= and its matching unencrypted private key as key="
            ) from None
    return ctx

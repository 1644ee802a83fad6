"""Why a connection to etcd failed, in words a user can act on (mostly TLS mismatches).

Apart from the transport (:mod:`elastictk.store.etcd_http`) because it runs only after a
failure: etcd answers a plain-HTTP client on its TLS port, a TLS client on its plain port and a
refused client certificate all by closing the connection, so telling them apart takes a probe
of its own (:func:`speaks_tls`) and a table of OpenSSL codes that the happy path never needs.
"""
from __future__ import annotations

import http.client
import socket
import ssl

from .endpoint import Endpoint

TLS_HINT = (
    "give the etcd client port's scheme and files: https:// endpoints (or --rdzv-conf "
    "protocol=https) with cacert= the CA that signed etcd's certificate, and cert=/key= a "
    "client certificate signed by the CA etcd trusts (--trusted-ca-file)"
)
_CERT_ALERTS = ("CERTIFICATE_REQUIRED", "UNKNOWN_CA", "BAD_CERTIFICATE", "UNSUPPORTED_CERTIFICATE",
                "CERTIFICATE_UNKNOWN", "HANDSHAKE_FAILURE")


class TLSProblem(str):
    """A reason that is a TLS misconfiguration: retrying or waiting cannot cure it."""


class NoAnswer(str):
    """A reason that is only slowness: the endpoint took the request and did not answer in time.

    A wait whose own deadline passed during such a call has timed out (``StoreTimeout``); the
    store is not known to be gone (``StoreUnreachable``) from that alone.
    """


def _tls_reason(exc: ssl.SSLError) -> TLSProblem:
    """What a TLS failure means for the user, and the fix (``exc.reason`` is OpenSSL's code)."""
    code = (getattr(exc, "reason", None) or "").upper()
    if isinstance(exc, ssl.SSLCertVerificationError):
        detail = getattr(exc, "verify_message", None) or code or str(exc)
        if "mismatch" in str(detail).lower() or "hostname" in str(detail).lower():
            return TLSProblem(
                f"etcd's certificate does not name this host ({detail}): connect by a name or "
                "IP address listed in the certificate's subjectAltName"
            )
        return TLSProblem(
            f"etcd's certificate is not trusted ({detail}): set cacert= to the CA that signed "
            "etcd's --cert-file"
        )
    if any(alert in code for alert in _CERT_ALERTS):
        return TLSProblem(
            f"etcd refused this client's certificate ({code.lower()}): set cert= and key= to a "
            "client certificate signed by the CA etcd trusts (its --trusted-ca-file)"
        )
    if "WRONG_VERSION_NUMBER" in code or "RECORD_LAYER_FAILURE" in code or "PACKET_LENGTH" in code:
        return TLSProblem(
            "it does not speak TLS (a plain-HTTP etcd client port?): use http:// endpoints and "
            "drop protocol=https/cacert/cert/key, or serve etcd with --cert-file"
        )
    return TLSProblem(f"TLS handshake failed ({code.lower() or exc}); {TLS_HINT}")


def speaks_tls(endpoint: Endpoint, timeout: float) -> bool | None:
    """Whether a TLS server answers a ClientHello at ``endpoint``; ``None`` if it cannot be told.

    Used only after a failure, to tell a TLS port spoken to in plain HTTP (and a plain port
    spoken to in TLS, and a refused client certificate) from other broken connections: etcd
    just closes the connection in all of them.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    outgoing = ssl.MemoryBIO()
    hello = ctx.wrap_bio(ssl.MemoryBIO(), outgoing)
    try:
        hello.do_handshake()
    except ssl.SSLWantReadError:
        pass
    try:
        sock = socket.create_connection((endpoint.host, endpoint.port), timeout=max(timeout, 0.01))
    except OSError:
        return None
    with sock:
        try:
            sock.sendall(outgoing.read())
            first = sock.recv(5)
        except (ConnectionResetError, BrokenPipeError):  # reset on a ClientHello: no TLS there
            return False
        except OSError:
            return None
    return len(first) > 0 and first[0] in (0x15, 0x16)  # a TLS alert or handshake record


_CLOSED = (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected,
           http.client.BadStatusLine, ssl.SSLEOFError, ssl.SSLZeroReturnError)


def _client_cert_refused(tls: ssl.SSLContext) -> TLSProblem:
    given = getattr(tls, "_elastictk_client_cert", "?")
    sent = ("this client sent none" if given is None else
            f"this client's {given} is not signed by it" if given != "?" else
            "this client sent none or one it does not trust")
    return TLSProblem(
        "etcd ended the TLS handshake: it requires a client certificate signed by the CA it "
        f"trusts (its --trusted-ca-file) and {sent}; set cert= and key= to a client "
        "certificate and key signed by that CA"
    )


def explain(exc: BaseException, endpoint: Endpoint, timeout: float,
            tls: ssl.SSLContext | None) -> str:
    """:func:`reason`, refined when a closed connection is really a TLS mismatch."""
    code = str(getattr(exc, "reason", None) or "").upper()
    if tls is not None and any(alert in code for alert in _CERT_ALERTS):
        return _client_cert_refused(tls)  # the same whether etcd sent its alert or just closed
    why = reason(exc, timeout)
    closed = isinstance(exc, _CLOSED) or (
        isinstance(exc, ssl.SSLError) and "EOF" in str(getattr(exc, "reason", "") or exc).upper()
    )
    if not closed:
        return why
    tls_there = speaks_tls(endpoint, min(timeout, 5.0))  # a loaded host answers late
    if tls is None and tls_there:
        return TLSProblem(
            "it serves TLS and was spoken to in plain HTTP: use https://host:port endpoints "
            "(or --rdzv-conf protocol=https) with cacert=, cert= and key="
        )
    if tls is not None and tls_there is False:
        return TLSProblem(
            "it does not speak TLS (a plain-HTTP etcd client port?): use http:// endpoints "
            "and drop protocol=https/cacert/cert/key, or serve etcd with --cert-file"
        )
    if tls is not None and tls_there:
        return _client_cert_refused(tls)
    return why


def reason(exc: BaseException, timeout: float) -> str:
    """A short, human reason for a failed connection or request."""
    if isinstance(exc, ssl.SSLError):
        return _tls_reason(exc)
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens there)"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return NoAnswer(f"no answer within {timeout:.3g}s")
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host ({exc.strerror})"
    if isinstance(exc, (http.client.RemoteDisconnected, http.client.BadStatusLine)):
        return "closed the connection without an HTTP answer (is it an etcd client port?)"
    if isinstance(exc, http.client.HTTPException):
        return f"broken HTTP answer ({type(exc).__name__}); is it an etcd client port?"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__

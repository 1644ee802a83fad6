"""Throwaway TLS certificates for a test etcd: a CA, a server certificate and a client one.

Apart from ``etcd.py`` because making certificates is its own job (the ``openssl`` command, its
extensions, file modes) that only TLS tests need; ``EtcdServer(tls=certs)`` just points etcd at
the files. Nothing here is a secret worth keeping.
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import ssl
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path


class OpensslNotInstalled(RuntimeError):
    """No ``openssl`` command to make test certificates with; the message says how to get it."""


@dataclass(frozen=True)
class TestCerts:
    """PEM files of a throwaway CA, an etcd server certificate and a client certificate."""

    __test__ = False  # not a pytest test class

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_context(self) -> ssl.SSLContext:
        """An :class:`ssl.SSLContext` trusting the CA and presenting the client certificate."""
        from ..store.etcd import tls_context

        return tls_context(self.ca, self.client_cert, self.client_key)

    def rdzv_conf(self) -> str:
        """The ``--rdzv-conf`` keys that make ``elastictk-run`` use these files."""
        return f"cacert={self.ca},cert={self.client_cert},key={self.client_key}"


def _openssl(*args: str | Path, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise OpensslNotInstalled(
            "no openssl command on PATH to make test certificates; install it with "
            "`apt-get install openssl`"
        )
    r = subprocess.run([exe, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=60)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"openssl {args[0]} failed (exit {r.returncode}): {last}")


_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def make_test_certs(directory: str | os.PathLike[str], *, host: str = "127.0.0.1",
                    days: int = 2) -> TestCerts:
    """A fresh CA in ``directory`` and, signed by it, a server certificate for ``host`` (an IP
    address goes in the subjectAltName as ``IP:``, a name as ``DNS:``) and a client certificate.

    Keys are unencrypted P-256, files mode 0600. For tests only: nothing here is a secret worth
    keeping. :class:`OpensslNotInstalled` when there is no ``openssl`` command.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    _openssl("req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.crt", "-days", str(days),
             "-subj", f"/CN=elastictk test CA {tag}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    kind = "IP" if _is_ip(host) else "DNS"
    leaves = {
        # clientAuth too: etcd's JSON gateway dials etcd's own gRPC port with this certificate,
        # and with --client-cert-auth that connection is refused without it
        "server": ("serverAuth,clientAuth", f"subjectAltName={kind}:{host}\n", host),
        "client": ("clientAuth", "", f"elastictk test client {tag}"),
    }
    for name, (usage, san, cn) in leaves.items():
        ext = d / f"{name}.ext"
        ext.write_text(
            f"{san}basicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            f"extendedKeyUsage={usage}\nsubjectKeyIdentifier=hash\n"
            "authorityKeyIdentifier=keyid\n"
        )
        _openssl("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={cn}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-set_serial", str(int(uuid.uuid4().int >> 64)), "-days", str(days),
                 "-extfile", ext.name, "-out", f"{name}.crt", cwd=d)
    for f in d.iterdir():
        if f.suffix == ".key":
            f.chmod(0o600)
    return TestCerts(d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt",
                     d / "client.key")


def _is_ip(host: str) -> bool:
    """Whether ``host`` is an IP address (it goes in a certificate as ``IP:``, not ``DNS:``)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True

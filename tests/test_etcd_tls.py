"""etcd over TLS with client certificates, against a real etcd started with certificates made here.

The certificates (a throwaway CA, a server certificate for 127.0.0.1, a client certificate) are
made with the ``openssl`` command in a temp dir; the tests skip, saying so, without openssl or
etcd. Every failure (no client certificate, one from another CA, a CA that did not sign etcd's
certificate, plain HTTP to the TLS port and the reverse, a missing or unreadable file) must be
one line naming the problem and its fix, through the store and through ``elastictk-run``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from elastictk.cli import parse_args
from elastictk.cli.values import UsageError
from elastictk.store import EndpointError, EtcdStore, StoreError, StoreUnreachable
from elastictk.store.etcd import parse_endpoints_and_scheme, tls_context
from elastictk.testing.etcd import EtcdNotInstalled, EtcdServer, find_etcd
from elastictk.testing.etcdcluster import EtcdCluster
from elastictk.testing.testcerts import OpensslNotInstalled, TestCerts, make_test_certs
from tests.helpers.store_contract import StoreContract

REPO = Path(__file__).resolve().parents[1]
TINY = "print('tiny worker ran')\n"


def _certs(directory: Path) -> TestCerts:
    try:
        return make_test_certs(directory)
    except OpensslNotInstalled as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TestCerts:
    """A CA, etcd's server certificate for 127.0.0.1 and a client certificate, all from it."""
    return _certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> TestCerts:
    """The same files from another, unrelated CA."""
    return _certs(tmp_path_factory.mktemp("other-ca"))


@pytest.fixture(scope="module")
def tls_etcd(certs: TestCerts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd whose client port is HTTPS only and requires a client certificate."""
    try:
        find_etcd()
    except EtcdNotInstalled as e:
        pytest.skip(str(e))
    with EtcdServer(tls=certs, base_dir=tmp_path_factory.mktemp("etcd-tls")) as server:
        yield server


@pytest.fixture
def url(tls_etcd: EtcdServer) -> str:
    return f"https://{tls_etcd.endpoint}"


def _one_line_error(e: pytest.ExceptionInfo[BaseException], *parts: str) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    for part in parts:
        assert part in msg, (part, msg)
    return msg


# -- the store over TLS ----------------------------------------------------------------------
@pytest.fixture
def store(url: str, certs: TestCerts) -> Iterator[EtcdStore]:
    s = EtcdStore(url, prefix=f"tls-{uuid.uuid4().hex}", timeout=10, tls=certs.client_context())
    yield s
    s.close()


class TestEtcdOverTLSContract(StoreContract):
    """Every Store contract test (set/get/add/compare_set/wait/delete/keys, the model test)."""

    model_examples = 15


def test_server_serves_https_only_and_requires_a_client_cert(tls_etcd: EtcdServer,
                                                             certs: TestCerts) -> None:
    assert tls_etcd.client_url == f"https://{tls_etcd.endpoint}"
    cmd = tls_etcd.command()
    for flag in ("--cert-file", "--key-file", "--trusted-ca-file", "--client-cert-auth"):
        assert flag in cmd
    assert tls_etcd.host == "127.0.0.1"  # loopback only


def test_clone_and_watch_keep_tls(store: EtcdStore) -> None:
    assert store.describe().startswith("etcd+https://")
    with store.clone() as other:
        assert other.tls is store.tls
        other.set("k", b"v")
    assert store.get("k", timeout=5) == b"v"
    lease = store.grant_lease(30)
    store.set_with_lease("leased", b"1", lease)
    assert store.revoke(lease) and store.try_get("leased") is None


def test_endpoint_schemes() -> None:
    assert parse_endpoints_and_scheme("https://a:1,https://b")[1] == "https"
    assert parse_endpoints_and_scheme("a:1")[1] is None
    with pytest.raises(EndpointError, match="mix"):
        parse_endpoints_and_scheme("https://a:1,http://b:2")
    with pytest.raises(EndpointError, match="scheme 'ftp'"):
        parse_endpoints_and_scheme("ftp://a:1")
    with pytest.raises(EndpointError, match="https://"):
        EtcdStore("http://127.0.0.1:1", tls=tls_context())


def test_a_tls_cluster_fails_over(certs: TestCerts, tmp_path: Path) -> None:
    try:
        find_etcd()
    except EtcdNotInstalled as e:
        pytest.skip(str(e))
    with EtcdCluster(3, base_dir=tmp_path, tls=certs) as cluster:
        urls = [f"https://{e}" for e in cluster.endpoints]
        with EtcdStore(urls, timeout=20, tls=certs.client_context()) as s:
            s.set("k", b"1")
            cluster.members[0].stop()
            assert s.try_get("k") == b"1"
            assert s.add("n", 1) == 1


# -- failures: one line naming the problem and the fix ---------------------------------------
def test_no_client_certificate(url: str, certs: TestCerts) -> None:
    with pytest.raises(StoreUnreachable) as e:
        EtcdStore(url, timeout=5, tls=tls_context(certs.ca))
    _one_line_error(e, url.removeprefix("https://"), "requires a client certificate",
                    "sent none", "set cert= and key=")


def test_client_certificate_from_another_ca(url: str, certs: TestCerts, other: TestCerts) -> None:
    with pytest.raises(StoreUnreachable) as e:
        EtcdStore(url, timeout=5, tls=tls_context(certs.ca, other.client_cert, other.client_key))
    _one_line_error(e, "requires a client certificate", str(other.client_cert),
                    "not signed by it", "set cert= and key=")


def test_wrong_ca_for_the_server(url: str, certs: TestCerts, other: TestCerts) -> None:
    with pytest.raises(StoreUnreachable) as e:
        EtcdStore(url, timeout=5, tls=tls_context(other.ca, certs.client_cert, certs.client_key))
    _one_line_error(e, "etcd's certificate is not trusted", "set cacert=")


def test_https_without_a_ca_uses_the_system_cas_and_says_so(url: str) -> None:
    with pytest.raises(StoreUnreachable) as e:
        EtcdStore(url, timeout=5)
    _one_line_error(e, "not trusted", "cacert=")


@pytest.mark.parametrize("scheme", ["http://", ""])
def test_plain_http_to_the_tls_port(tls_etcd: EtcdServer, scheme: str) -> None:
    with pytest.raises(StoreUnreachable) as e:
        EtcdStore(f"{scheme}{tls_etcd.endpoint}", timeout=5)
    _one_line_error(e, tls_etcd.endpoint, "serves TLS", "plain HTTP", "https://")


def test_tls_to_a_plain_http_port(etcd_server: EtcdServer, certs: TestCerts) -> None:
    with pytest.raises(StoreUnreachable) as e:
        EtcdStore(f"https://{etcd_server.endpoint}", timeout=5, tls=certs.client_context())
    _one_line_error(e, etcd_server.endpoint, "does not speak TLS", "http://")


def test_a_name_the_certificate_does_not_list(tls_etcd: EtcdServer, certs: TestCerts) -> None:
    with pytest.raises(StoreUnreachable) as e:
        EtcdStore(f"https://localhost:{tls_etcd.client_port}", timeout=5,
                  tls=certs.client_context())
    _one_line_error(e, "does not name this host", "subjectAltName")


def test_bad_files_are_one_line(tmp_path: Path, certs: TestCerts) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(StoreError) as e:
        tls_context(missing)
    _one_line_error(e, str(missing), "does not exist")
    with pytest.raises(StoreError) as e:
        tls_context(tmp_path)
    _one_line_error(e, str(tmp_path), "is a directory")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(StoreError) as e:
        tls_context(garbage)
    _one_line_error(e, str(garbage), "no usable CA certificate")
    with pytest.raises(StoreError) as e:
        tls_context(certs.ca, certs.client_cert, certs.server_key)  # the wrong key
    _one_line_error(e, str(certs.client_cert), "matching")
    with pytest.raises(StoreError) as e:
        tls_context(certs.ca, None, certs.client_key)
    _one_line_error(e, "without its certificate")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_is_one_line(tmp_path: Path, certs: TestCerts) -> None:
    locked = tmp_path / "ca.pem"
    locked.write_bytes(certs.ca.read_bytes())
    locked.chmod(0)
    with pytest.raises(StoreError) as e:
        tls_context(locked)
    _one_line_error(e, str(locked), "not readable")


# -- --rdzv-conf ---------------------------------------------------------------------------
ETCD = ["--rdzv-backend", "etcd", "--rdzv-id", "tls-job", "--nnodes", "1"]


@pytest.fixture
def x(tmp_path: Path) -> str:
    """A training script that exists (parse_args checks)."""
    script = tmp_path / "x.py"
    script.write_text(TINY)
    return str(script)


def test_rdzv_conf_takes_torchs_tls_keys(certs: TestCerts, x: str) -> None:
    conf = parse_args([*ETCD, "--rdzv-endpoint", "https://127.0.0.1:2379",
                       "--rdzv-conf", f"{certs.rdzv_conf()},join_timeout=5", x]).rdzv_conf
    assert conf == {"protocol": "https", "cacert": str(certs.ca), "cert": str(certs.client_cert),
                    "key": str(certs.client_key), "join_timeout": 5.0}
    v2 = parse_args([*ETCD, "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "127.0.0.1:2379",
                     "--rdzv-conf", f"protocol=HTTPS,ca_cert={certs.ca},ssl_cert="
                     f"{certs.client_cert},ssl_cert_key={certs.client_key}", x]).rdzv_conf
    assert {k: v2[k] for k in ("protocol", "cacert", "cert", "key")} == {
        k: conf[k] for k in ("protocol", "cacert", "cert", "key")}
    # files alone mean TLS; no TLS key at all means plain HTTP, as before
    alone = parse_args([*ETCD, "--rdzv-conf", f"cacert={certs.ca}", x]).rdzv_conf
    assert alone["protocol"] == "https"
    assert "protocol" not in parse_args([*ETCD, x]).rdzv_conf


@pytest.mark.parametrize("endpoint,conf,expected", [
    ("127.0.0.1", "protocol=gopher", "protocol='gopher': use http or https"),
    ("http://127.0.0.1", "cacert={ca}", "cacert are for etcd over TLS"),
    ("127.0.0.1", "protocol=http,cert={crt},key={key}", "cert, key are for etcd over TLS"),
    ("https://127.0.0.1", "protocol=http", "make them agree"),
    ("https://a:1,http://b:2", "", "mixes http:// and https://"),
    ("ftp://a:1", "", "scheme 'ftp'"),
    ("127.0.0.1", "cacert={ca},ca_cert={ca}", "cacert is given twice"),
    ("127.0.0.1", "cacert", "is not key=value"),
    ("127.0.0.1", "bogus=1", "known keys: join_timeout"),
    ("127.0.0.1", "cacert=/no/such/ca.pem", "/no/such/ca.pem does not exist"),
    ("127.0.0.1", "key={key}", "without its certificate"),
])
def test_bad_tls_conf_is_a_usage_error(certs: TestCerts, endpoint: str, conf: str,
                                       expected: str, x: str) -> None:
    text = conf.format(ca=certs.ca, crt=certs.client_cert, key=certs.client_key)
    argv = [*ETCD, "--rdzv-endpoint", endpoint, *(["--rdzv-conf", text] if text else []), x]
    with pytest.raises(UsageError) as e:
        parse_args(argv)
    _one_line_error(e, expected)
    if expected.startswith("known keys"):
        assert "cacert" in str(e.value) and "ssl_cert_key" in str(e.value)


def test_tls_keys_with_another_backend_warn(certs: TestCerts, x: str) -> None:
    config = parse_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                         "--rdzv-conf", f"cacert={certs.ca}", x])
    assert "cacert" not in config.rdzv_conf
    assert any("only used by the etcd backend" in w for w in config.warnings)


# -- through elastictk-run -----------------------------------------------------------------
def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "tiny.py"
    script.write_text(TINY)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTICTK_"))}
    return subprocess.run(
        [sys.executable, "-m", "elastictk.run", "--rdzv-backend", "etcd", "--nnodes", "1",
         "--rdzv-id", f"tls-{uuid.uuid4().hex[:8]}", *args, str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,  # a hang guard: 120 s ran out under load
    )


def test_elastictk_run_over_tls(tmp_path: Path, url: str, certs: TestCerts) -> None:
    r = _run(tmp_path, "--rdzv-endpoint", url, "--rdzv-conf", certs.rdzv_conf())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tiny worker ran" in r.stdout


def test_elastictk_run_with_torchs_etcd_v2_key_names(tmp_path: Path, tls_etcd: EtcdServer,
                                                     certs: TestCerts) -> None:
    r = _run(tmp_path, "--rdzv-endpoint", tls_etcd.endpoint, "--rdzv-conf",
             f"protocol=https,ca_cert={certs.ca},ssl_cert={certs.client_cert},"
             f"ssl_cert_key={certs.client_key}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tiny worker ran" in r.stdout


def _error_line(r: subprocess.CompletedProcess[str], *parts: str) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("elastictk-run: error: ")]
    assert len(errors) == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    for part in parts:
        assert part in errors[0], (part, errors[0])
    assert "tiny worker ran" not in r.stdout
    return errors[0]


def test_elastictk_run_with_a_wrong_ca_fails_with_one_line(tmp_path: Path, url: str,
                                                           certs: TestCerts,
                                                           other: TestCerts) -> None:
    r = _run(tmp_path, "--rdzv-endpoint", url, "--rdzv-conf",
             f"cacert={other.ca},cert={certs.client_cert},key={certs.client_key}")
    assert r.returncode == 2, r.stderr[-3000:]
    _error_line(r, "not trusted", "set cacert=")


def test_elastictk_run_plain_http_to_tls_fails_with_one_line(tmp_path: Path,
                                                             tls_etcd: EtcdServer) -> None:
    r = _run(tmp_path, "--rdzv-endpoint", f"http://{tls_etcd.endpoint}")
    assert r.returncode == 2, r.stderr[-3000:]
    _error_line(r, "serves TLS", "https://")


@pytest.mark.parametrize("which", ["cacert", "cert", "key"])
def test_elastictk_run_missing_file_exits_2(tmp_path: Path, url: str, certs: TestCerts,
                                            which: str) -> None:
    files = {"cacert": certs.ca, "cert": certs.client_cert, "key": certs.client_key}
    files[which] = tmp_path / f"missing-{which}.pem"
    r = _run(tmp_path, "--rdzv-endpoint", url, "--rdzv-conf",
             ",".join(f"{k}={v}" for k, v in files.items()))
    assert r.returncode == 2, r.stderr[-3000:]
    _error_line(r, "--rdzv-conf", str(files[which]), "does not exist")


def test_elastictk_run_unusable_file_exits_2(tmp_path: Path, url: str, certs: TestCerts) -> None:
    r = _run(tmp_path, "--rdzv-endpoint", url, "--rdzv-conf", f"cacert={tmp_path}")
    assert r.returncode == 2, r.stderr[-3000:]
    _error_line(r, "--rdzv-conf", str(tmp_path), "is a directory")
    garbage = tmp_path / "key.pem"
    garbage.write_text("junk\n")
    r = _run(tmp_path, "--rdzv-endpoint", url, "--rdzv-conf",
             f"cacert={certs.ca},cert={certs.client_cert},key={garbage}")
    assert r.returncode == 2, r.stderr[-3000:]
    _error_line(r, "--rdzv-conf", str(garbage), "matching unencrypted private key")


def test_a_port_that_resets_a_client_hello_does_not_speak_tls() -> None:
    """A plain server that resets the connection on TLS bytes (a loaded etcd did) is told apart
    from one that cannot be reached: it was "cannot be told" and the one-line error lost its fix."""
    import socket
    import struct
    import threading

    from elastictk.store.etcd_http import speaks_tls
    from elastictk.store.endpoint import Endpoint

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def reset_one() -> None:
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
        conn.close()

    t = threading.Thread(target=reset_one)
    t.start()
    try:
        assert speaks_tls(Endpoint("127.0.0.1", port), 5.0) is False
    finally:
        t.join(10)
        listener.close()

"""The nodes-and-rendezvous part of :func:`~elastictk.cli.resolve.config_from_namespace`.

``--nnodes``, ``--nproc-per-node``, ``--standalone`` (and torchrun's single-node default), the
static backend's ``--master-*``/``--node-rank``, ``--rdzv-backend``/``--rdzv-endpoint``/
``--rdzv-id``/``--rdzv-conf``: read into one :class:`Rendezvous`, each bad value reported as one
line naming its flag. :class:`Flags` is the parsed namespace with the warnings gathered so far,
shared with the other parts in :mod:`.resolve`.
"""
from __future__ import annotations

import argparse
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..store.base import StoreError
from ..store.endpoint import Endpoint, EndpointError, parse_endpoint
from ..store.etcd import split_scheme, tls_context
from .config import (
    DEFAULT_C10D_PORT, DEFAULT_ETCD_PORT, DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT,
    MIN_NPROC_BOUND, NPROC_PER_CPU, max_nproc_per_node,
)
from .values import (
    UsageError, label, parse_backend, parse_bool, parse_int, parse_nnodes, parse_nproc,
    NPROC_WORDS, parse_port, parse_rdzv_conf, run_id_problem, unquote_conf,
)

#: ``--rdzv-conf`` keys for etcd over TLS, each to its canonical name: torch's etcd backend
#: spells them protocol/cacert/cert/key, its etcd-v2 backend ca_cert/ssl_cert/ssl_cert_key.
TLS_CONF_KEYS = {
    "protocol": "protocol", "cacert": "cacert", "cert": "cert", "key": "key",
    "ca_cert": "cacert", "ssl_cert": "cert", "ssl_cert_key": "key",
}


def flag_on(ns: argparse.Namespace, dest: str, flag: str) -> bool:
    value = getattr(ns, dest)
    return value if isinstance(value, bool) else parse_bool(value, label(flag, value))


def _resolve_nproc(value: int | str, where: str) -> int:
    """A device word to a count, as torchrun's ``determine_local_world_size`` does: ``auto``
    counts the devices of ``torch.accelerator`` (CUDA, XPU, MPS, HPU, PrivateUse1 backends...)
    and falls back to the CPUs; ``gpu``/``xpu``/a backend's name need that device. torch is
    imported only when a device is asked for."""
    if isinstance(value, int):
        return value
    if value == "cpu":
        if hasattr(os, "sched_getaffinity"):  # respects taskset/cgroups, as torch's cpu_count
            return len(os.sched_getaffinity(0))
        return os.cpu_count() or 1
    import torch  # noqa: PLC0415  (slow import, needed only here)

    if value == "auto":
        if torch.accelerator.is_available():
            return int(torch.accelerator.device_count())
        return _resolve_nproc("cpu", where)
    module: Any = {"gpu": torch.cuda, "xpu": getattr(torch, "xpu", None)}.get(value)
    name = {"gpu": "CUDA", "xpu": "XPU"}.get(value, value)
    if module is None and value == torch._C._get_privateuse1_backend_name():
        module = getattr(torch, value, None)  # a PrivateUse1 backend registers its module here
    if module is None:
        raise UsageError(f"{where}: unknown device {value!r}; use a number of workers, or {NPROC_WORDS}")
    if not module.is_available():
        raise UsageError(f"{where}: {name} is not available on this host; use a number or cpu")
    return int(module.device_count())


def _endpoint(text: str, where: str, default_port: int) -> Endpoint:
    try:
        return parse_endpoint(text, default_port=default_port)
    except EndpointError as e:
        raise UsageError(f"{where}: {e}") from None


def host(text: str, where: str) -> str:
    """A bare host (``[v6]`` brackets allowed); a port here is almost always a mistake."""
    try:
        parse_endpoint(text)
    except EndpointError:
        return _endpoint(text, where, 0).host
    raise UsageError(f"{where}: give a host without a port")


class Flags:
    """The parsed flags, the environment, and the warnings gathered while resolving them."""

    def __init__(self, ns: argparse.Namespace, env: Mapping[str, str]) -> None:
        self.ns, self.env = ns, env
        self.warnings: list[str] = []

    def at(self, dest: str, flag: str) -> str:
        """How an error line names the flag ``dest`` was read from, with its value."""
        return label(flag, getattr(self.ns, dest))

    def on(self, dest: str, flag: str) -> bool:
        return flag_on(self.ns, dest, flag)


@dataclass
class Rendezvous:
    """The node counts and rendezvous settings, as they are worked out step by step."""

    min_nodes: int
    max_nodes: int
    nproc: int
    backend: str
    endpoint_text: str
    run_id: str
    standalone: bool = False
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    node_rank: int = 0
    endpoint: Endpoint | None = None
    path: str | None = None
    members: tuple[Endpoint, ...] = ()
    etcd_scheme: str | None = None  # http/https when --rdzv-endpoint wrote one
    conf: dict[str, float | bool | str] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        """The :class:`LaunchConfig` fields this part decides."""
        return dict(
            min_nodes=self.min_nodes, max_nodes=self.max_nodes, nproc_per_node=self.nproc,
            rdzv_backend=self.backend, rdzv_endpoint=self.endpoint, rdzv_path=self.path,
            run_id=self.run_id, rdzv_conf=self.conf, standalone=self.standalone,
            node_rank=self.node_rank, master_addr=self.master_addr, master_port=self.master_port,
            rdzv_endpoints=self.members,
        )


def resolve_rendezvous(c: Flags) -> Rendezvous:
    """Nodes, workers per node, and how the nodes meet: backend, endpoint, job id, conf."""
    rdzv = _nodes(c)
    _standalone(c, rdzv)
    _master(c, rdzv)
    _endpoints(c, rdzv)
    _check_endpoints(c, rdzv)
    where = c.at("rdzv_conf", "--rdzv-conf")
    text, tls = _split_tls(unquote_conf(c.ns.rdzv_conf or ""), where)
    try:
        rdzv.conf = dict(parse_rdzv_conf(text, where))
    except UsageError as e:
        if "known keys: " not in str(e):
            raise
        raise UsageError(f"{e}, {', '.join(TLS_CONF_KEYS)}") from None
    _etcd_tls(c, rdzv, tls, where)
    if "is_host" in rdzv.conf and rdzv.backend != "c10d":
        c.warnings.append(
            f"--rdzv-conf is_host is only used by the c10d backend; ignored with {rdzv.backend}"
        )
    return rdzv


def _split_tls(text: str, where: str) -> tuple[str, dict[str, str]]:
    """``--rdzv-conf`` without its TLS keys, and those (by canonical name, values as given)."""
    rest: list[str] = []
    tls: dict[str, str] = {}
    for item in text.split(","):
        key, eq, value = (s.strip() for s in item.partition("="))
        name = TLS_CONF_KEYS.get(key)
        if name is None:
            rest.append(item)
            continue
        if not eq or not value:
            raise UsageError(f"{where}: {item.strip()!r} is not key=value; write k1=v1,k2=v2")
        if name in tls:
            raise UsageError(f"{where}: {name} is given twice (as {key} too); give each key once")
        tls[name] = value
    return ",".join(rest), tls


def _etcd_tls(c: Flags, rdzv: Rendezvous, tls: dict[str, str], where: str) -> None:
    """protocol/cacert/cert/key into ``rdzv.conf``: checked here (the files readable and usable)
    so that a bad one is a usage error, not a failure after the launcher started."""
    if rdzv.backend != "etcd":
        if tls:
            c.warnings.append(f"--rdzv-conf {', '.join(tls)} are only used by the etcd backend; "
                              f"ignored with {rdzv.backend}")
        return
    protocol = tls.get("protocol", "").lower() or None
    if protocol not in (None, "http", "https"):
        raise UsageError(f"{where}: protocol={tls['protocol']!r}: use http or https")
    if protocol and rdzv.etcd_scheme and protocol != rdzv.etcd_scheme:
        raise UsageError(f"{where}: protocol={protocol} but --rdzv-endpoint is written "
                         f"{rdzv.etcd_scheme}://; make them agree")
    files = {k: tls[k] for k in ("cacert", "cert", "key") if k in tls}
    scheme = protocol or rdzv.etcd_scheme or ("https" if files else "http")
    if scheme == "http":
        if files:
            raise UsageError(f"{where}: {', '.join(files)} are for etcd over TLS, but the "
                             "protocol is http: write https:// endpoints (or protocol=https), "
                             "or leave them out")
        return
    try:
        tls_context(files.get("cacert"), files.get("cert"), files.get("key"))
    except StoreError as e:
        raise UsageError(f"{where}: {e}") from None
    rdzv.conf.update({"protocol": "https"},
                     **{k: os.path.abspath(os.path.expanduser(v)) for k, v in files.items()})


def _nodes(c: Flags) -> Rendezvous:
    """``--nnodes``, ``--nproc-per-node`` (within :func:`max_nproc_per_node`), the backend."""
    ns = c.ns
    min_nodes, max_nodes = parse_nnodes(ns.nnodes or "1:1", c.at("nnodes", "--nnodes"))
    nproc_where = c.at("nproc_per_node", "--nproc-per-node")
    nproc = _resolve_nproc(parse_nproc(ns.nproc_per_node or "1", nproc_where), nproc_where)
    bound = max_nproc_per_node()
    if nproc > bound:
        raise UsageError(
            f"{nproc_where}: at most {bound} workers per node on this host (the larger of "
            f"{MIN_NPROC_BOUND} and {NPROC_PER_CPU} x its {os.cpu_count() or 1} CPUs): each "
            "worker is a process; use fewer workers per node, or more nodes"
        )
    backend = parse_backend(ns.rdzv_backend or "static", c.at("rdzv_backend", "--rdzv-backend"))
    run_id = ns.rdzv_id if ns.rdzv_id is not None else "none"
    return Rendezvous(min_nodes, max_nodes, nproc, backend, (ns.rdzv_endpoint or "").strip(), run_id)


def _standalone(c: Flags, rdzv: Rendezvous) -> None:
    """``--standalone``, or torchrun's single-node default: a c10d store on a free port."""
    ns = c.ns
    standalone = c.on("standalone", "--standalone")
    if standalone:
        _standalone_flag(c, rdzv)
    elif (rdzv.backend == "static" and not rdzv.endpoint_text and ns.master_port is None
          and rdzv.max_nodes == 1):
        standalone = True  # torchrun's single-node default: a c10d store on a free port
        if ns.rdzv_id is not None:
            c.warnings.append("one node with no --master-port runs a local c10d store with a "
                              "random id (as torchrun does); ignoring --rdzv-id")
    if standalone:
        rdzv.standalone = True
        rdzv.backend, rdzv.endpoint_text, rdzv.run_id = "c10d", "localhost:0", str(uuid.uuid4())


def _standalone_flag(c: Flags, rdzv: Rendezvous) -> None:
    """What ``--standalone`` overrides, warned about; a job of several nodes refused."""
    overridden = [f for d, f in (("rdzv_backend", "--rdzv-backend"),
                                 ("rdzv_endpoint", "--rdzv-endpoint"), ("rdzv_id", "--rdzv-id"))
                  if getattr(c.ns, d) is not None]
    if overridden:
        c.warnings.append(f"--standalone ignores {', '.join(overridden)}: it hosts a c10d "
                          "store on a free port (its records sealed with a random per-run token) "
                          "and uses a random id")
    if rdzv.min_nodes > 1:
        raise UsageError(
            f"--standalone runs one node, but {c.at('nnodes', '--nnodes')} needs "
            f"{rdzv.min_nodes}: drop --standalone and give every node the same --rdzv-endpoint"
        )
    if rdzv.max_nodes > 1:
        c.warnings.append(f"--standalone runs one node: ignoring {c.at('nnodes', '--nnodes')}")
        rdzv.max_nodes = 1


def _master(c: Flags, rdzv: Rendezvous) -> None:
    """``--master-port``, ``--master-addr``, ``--node-rank`` (the static backend's)."""
    ns = c.ns
    if ns.master_port is not None:
        rdzv.master_port = parse_port(ns.master_port, c.at("master_port", "--master-port"))
    if ns.master_addr is not None:
        rdzv.master_addr = host(ns.master_addr, c.at("master_addr", "--master-addr"))
    if ns.node_rank is not None:
        rdzv.node_rank = parse_int(ns.node_rank, c.at("node_rank", "--node-rank"), minimum=0)


def _endpoints(c: Flags, rdzv: Rendezvous) -> None:
    """``--rdzv-endpoint`` read the way the backend takes it: a path, host:port, or a list."""
    where, text = c.at("rdzv_endpoint", "--rdzv-endpoint"), rdzv.endpoint_text
    if rdzv.backend == "file":
        if not text:
            raise UsageError("--rdzv-backend file needs --rdzv-endpoint PATH (a file on a "
                             "filesystem every node can reach)")
        rdzv.path = text
    elif rdzv.backend == "static":
        _static_endpoint(c, rdzv, where)
    elif rdzv.backend == "etcd":
        schemes: set[str] = set()
        members: list[Endpoint] = []
        for t in (text or "localhost").split(","):
            if not t.strip():
                continue
            try:  # http:// and https:// are allowed here (https: etcd over TLS)
                scheme, t = split_scheme(t)
            except EndpointError as e:
                raise UsageError(f"{where}: {e}") from None
            schemes.update([scheme] if scheme else [])
            members.append(_endpoint(t, where, DEFAULT_ETCD_PORT))
        if len(schemes) > 1:
            raise UsageError(f"{where}: mixes http:// and https://; write every member the "
                             "same way")
        rdzv.members, rdzv.etcd_scheme = tuple(members), (schemes.pop() if schemes else None)
        if not rdzv.members:
            raise UsageError(f"{where}: no etcd endpoint given; use host:port[,host:port...]")
        rdzv.endpoint = rdzv.members[0]
    else:
        rdzv.endpoint = _endpoint(text or "localhost", where, DEFAULT_C10D_PORT)


def _static_endpoint(c: Flags, rdzv: Rendezvous, where: str) -> None:
    if rdzv.endpoint_text:
        rdzv.endpoint = _endpoint(rdzv.endpoint_text, where, rdzv.master_port)
    else:
        rdzv.endpoint = Endpoint(rdzv.master_addr, rdzv.master_port)
    if rdzv.min_nodes != rdzv.max_nodes:  # torchrun would wait for MAX nodes, and only them
        raise UsageError(f"{c.at('nnodes', '--nnodes')}: the static backend (the default) runs a "
                         "fixed number of nodes; give --nnodes N, or --rdzv-backend c10d "
                         "--rdzv-endpoint HOST:PORT for MIN:MAX")
    if rdzv.master_port == 0 and rdzv.max_nodes > 1:
        raise UsageError(f"{c.at('master_port', '--master-port')}: port 0 (a free port only "
                         "node 0 knows) cannot work with several nodes; give a fixed port")


def _check_endpoints(c: Flags, rdzv: Rendezvous) -> None:
    """Static-only flags given to another backend, port 0 with several nodes, the job id."""
    ns, backend = c.ns, rdzv.backend
    if backend in ("c10d", "etcd"):
        if rdzv.node_rank != 0:
            c.warnings.append(
                f"--node-rank is only used by the static backend; ignored with {backend}"
            )
        if ns.master_addr is not None or ns.master_port is not None:
            c.warnings.append(f"--master-addr/--master-port are only used by the static "
                              f"backend; ignored with {backend}")
    ep = rdzv.endpoint
    if ep is not None and ep.port == 0 and rdzv.max_nodes > 1:
        raise UsageError(f"{c.at('rdzv_endpoint', '--rdzv-endpoint')}: port 0 (a free port only "
                         f"this node knows) cannot work with up to {rdzv.max_nodes} nodes; "
                         "give a fixed port")
    problem = run_id_problem(rdzv.run_id)
    if problem is not None:
        raise UsageError(f"{c.at('rdzv_id', '--rdzv-id')}: {problem}")

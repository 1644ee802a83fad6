"""Test hosts as Linux network namespaces on a private bridge: several "machines" on one box.

Each :class:`Host` is a network namespace with loopback up and one veth link (``eth0``) into a
bridge that lives in a namespace of its own, so nothing is added to the root namespace and no
packet can leave for a real network: the 10.250.x.0/24 addresses exist only in namespaces this
module made. Names carry a per-run random tag, so parallel test runs never clash.

Processes run inside a host with ``ip netns exec`` (which execs, so the PID we hold is the
process's own); :meth:`Hosts.close` kills every one of them by PID and deletes the namespaces,
which takes their links with them. :meth:`Host.call` runs a Python function in a thread that
entered the host's namespace (the network namespace is per thread on Linux), so the test
process itself can reach a host, e.g. to start an etcd member there or read a store.
"""
from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from elastictk.testing.etcd import EtcdServer

T = TypeVar("T")
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsUnavailable(RuntimeError):
    """``ip netns`` does not work here (not root, or iproute2 missing)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cp = subprocess.run(["ip", *args], text=True, capture_output=True, timeout=30)
    if check and cp.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {cp.stderr.strip()}")
    return cp


def _enter(ns: str) -> None:
    """Thread initializer: move the calling thread (only) into network namespace ``ns``."""
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Host:
    """One test host: a namespace, its address, and the processes started in it."""

    def __init__(self, hosts: "Hosts", index: int, name: str, addr: str) -> None:
        self.hosts, self.index, self.ns, self.addr = hosts, index, name, addr
        self.link = f"v{index}"  # the bridge-side end of this host's veth (in the bridge namespace)
        self.procs: list[subprocess.Popen[str]] = []
        # One long-lived thread per host: children it forks inherit its namespace, and a
        # PR_SET_PDEATHSIG set by them follows this thread, which lives until close().
        self._thread = ThreadPoolExecutor(1, f"netns-{name}", initializer=_enter, initargs=(name,))

    def popen(self, argv: Sequence[str], env: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen[str]:
        """Start ``argv`` inside this host; reaped (by PID) when the hosts are closed."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], text=True, env=env, **kw)
        self.procs.append(p)
        return p

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in a thread inside this host's namespace and return its result."""
        return self._thread.submit(fn, *args).result()

    def wait_listening(self, addr: str, port: int, timeout: float = 60) -> None:
        """Block until something accepts TCP connections at ``addr:port`` as seen from this
        host; ``TimeoutError`` naming the address after ``timeout`` seconds."""
        def probe() -> bool:
            try:
                socket.create_connection((addr, port), timeout=1).close()
                return True
            except OSError:
                return False

        deadline = time.monotonic() + timeout
        while not self.call(probe):
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens at {addr}:{port} after {timeout:g}s")
            time.sleep(0.05)

    def link_down(self) -> None:
        """Cut the cable: the bridge side goes down, packets to and from this host are dropped."""
        ip("-n", self.hosts.bridge_ns, "link", "set", self.link, "down")

    def link_up(self) -> None:
        ip("-n", self.hosts.bridge_ns, "link", "set", self.link, "up")

    def kill_all(self) -> None:
        for p in self.procs:
            kill_tree(p)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def __repr__(self) -> str:
        return f"Host({self.ns}, {self.addr})"


def kill_tree(p: "subprocess.Popen[str]") -> None:
    """SIGKILL what ``p`` (an ``ip netns exec``, which forks) started, then ``p`` itself: its
    descendants by PID, from /proc, read before anything dies so none is reparented first."""
    from elastictk.lifetime import procfs

    if p.poll() is not None:
        return
    for pid in sorted(procfs.descendants(p.pid), reverse=True) + [p.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Hosts:
    """``count`` hosts on one bridge; a context manager that tears everything down."""

    def __init__(self, count: int) -> None:
        self.tag = secrets.token_hex(3)
        self.subnet = f"10.250.{secrets.randbelow(250) + 1}"
        self.bridge_ns = f"etk-{self.tag}-br"
        self.hosts: list[Host] = []
        self._made: list[str] = []
        try:
            self._build(count)
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def _build(self, count: int) -> None:
        br = self.bridge_ns
        self._add_ns(br)
        ip("-n", br, "link", "add", "br0", "type", "bridge")
        ip("-n", br, "link", "set", "br0", "up")
        for i in range(count):
            name = f"etk-{self.tag}-h{i}"
            self._add_ns(name)
            host = Host(self, i, name, f"{self.subnet}.{i + 1}")
            self.hosts.append(host)
            ip("-n", br, "link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", name)
            ip("-n", br, "link", "set", host.link, "master", "br0", "up")
            ip("-n", name, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def close(self) -> None:
        """Kill every process started in a host (by PID), stop the host threads, delete the
        namespaces (their veth links go with them). Idempotent; also after a failed test."""
        for h in self.hosts:
            h.kill_all()
        for h in self.hosts:
            h._thread.shutdown(wait=True)
        for name in reversed(self._made):
            ip("netns", "del", name, check=False)
        self._made.clear()

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def etcd_members(hosts: Hosts, base: Path) -> list[EtcdServer]:
    """One etcd member per host (started from inside the host), forming one cluster."""
    initial = ",".join(f"etcd{h.index}=http://{h.addr}:2380" for h in hosts)
    token = f"elastictk-{hosts.tag}"
    members = [EtcdServer(name=f"etcd{h.index}", host=h.addr, client_port=2379, peer_port=2380,
                          initial_cluster=initial, cluster_token=token, base_dir=base) for h in hosts]
    try:
        for h, m in zip(hosts, members):
            h.call(m.launch)  # forked from the host's thread: the member runs in its namespace
        for h, m in zip(hosts, members):
            h.call(m.wait_ready)
    except BaseException:
        for m in members:
            m.close()
        raise
    return members


def leftover_namespaces(tag: str) -> list[str]:
    """Namespaces of run ``tag`` that still exist (a teardown check)."""
    out = ip("netns", "list").stdout.split("\n")
    return [line.split()[0] for line in out if line.startswith(f"etk-{tag}-")]


def netns_works() -> str | None:
    """None when ``ip netns`` can be used here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"etk-probe-{secrets.token_hex(3)}"
    try:
        cp = ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "no `ip` binary: apt-get install iproute2"
    if cp.returncode != 0:
        return f"ip netns add failed: {cp.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


__all__ = ["Host", "Hosts", "NetnsUnavailable", "etcd_members", "leftover_namespaces", "netns_works"]

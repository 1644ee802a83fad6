"""A real Slurm cluster for tests: ``munged``, ``slurmctld`` and one ``slurmd`` per node.

elastictk's Slurm side (the defaults taken under ``srun``, pre-emption, ``scontrol requeue``,
``scontrol update ... State=DRAIN``) is only known to work where Slurm itself runs it. This
module starts Debian's ``slurm-wlm`` 22.05 and ``munge`` as a cluster of its own, the way
:mod:`elastictk.testing.etcd` starts etcd:

- its own munge key (random, in the cluster's temp dir) and its own ``munged`` socket, pid,
  seed and log files, so the machine's ``/etc/munge`` key and ``/run/munge`` socket are never
  used (``AuthInfo=socket=...`` points Slurm at ours);
- a generated ``slurm.conf`` in the temp dir (clients read it through ``SLURM_CONF``), every
  state and spool directory in the temp dir too, no cgroups (``proctrack/linuxproc``,
  ``task/none``), one CPU per node (one task per node), short timeouts, ``ReturnToService=2``;
- each daemon in the network namespace of its host, so each node has a real address of its
  own, and with that host's name as its host name; the names resolve through a hosts file of
  the cluster's, mounted over ``/etc/hosts`` for the daemons and the jobs they start (job
  scripts name the first node as their rendezvous host, as on a real cluster).

Nothing outlives the cluster: the daemons die with the thread that started them
(``PR_SET_PDEATHSIG``), and :meth:`SlurmCluster.close` cancels the jobs, then kills every
process left in the nodes' namespaces (``slurmstepd`` and the job's tasks daemonize away from
``slurmd``, so they are found by namespace, not by parent), stops the daemons by PID and
removes the temp dir.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..lifetime.reaper import dies_with_caller

INSTALL_HINT = "install them with `apt-get install slurm-wlm munge` (Slurm 22.05)"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue",
            "nsenter", "unshare")
#: The ports of slurm.conf's defaults; each daemon has a network namespace (an address) of its own.
CTLD_PORT, SLURMD_PORT = 6817, 6818


class SlurmNotInstalled(RuntimeError):
    """A Slurm or munge binary is missing; the message names it and how to install them."""


class SlurmStartError(RuntimeError):
    """A daemon did not come up; the message quotes its log's last lines and names the log."""


def missing_binaries() -> list[str]:
    """The Slurm and munge programs this module needs that are not installed."""
    return [b for b in BINARIES if _which(b) is None]


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None)


def _exe(name: str) -> str:
    exe = _which(name)
    if exe is None:
        raise SlurmNotInstalled(f"no {name} on PATH or in /usr/sbin, /usr/bin; {INSTALL_HINT}")
    return exe


@dataclass(frozen=True)
class SlurmHost:
    """Where one daemon runs: its Slurm name, its address and its network namespace (None:
    this process's own, where ``addr`` must be one of its addresses)."""

    name: str
    addr: str
    netns: str | None = None


def _tail(path: Path, lines: int = 4) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return "no log written"
    return " | ".join(t.strip() for t in text) or "empty log"


class SlurmCluster:
    """``slurmctld`` on ``controller``, a ``slurmd`` on each of ``nodes``, one partition
    ``main`` holding them all; a context manager. Clients run through :meth:`client` (inside the
    controller's namespace, with ``SLURM_CONF`` set)."""

    def __init__(self, controller: SlurmHost, nodes: Sequence[SlurmHost], *,
                 base_dir: str | os.PathLike[str] | None = None, start_timeout: float = 60.0,
                 cred_expire: int = 10) -> None:
        for b in BINARIES:
            _exe(b)
        if not nodes:
            raise ValueError("a Slurm cluster needs at least one node")
        self.controller, self.nodes = controller, list(nodes)
        self.start_timeout, self.cred_expire = start_timeout, cred_expire
        self.cpus = os.cpu_count() or 1  # as slurmd finds them; select/linear gives whole nodes
        self.tag = secrets.token_hex(3)
        self.root = Path(tempfile.mkdtemp(prefix="elastictk-slurm-", dir=base_dir))
        self.root.chmod(0o755)  # job scripts are read from the spool by the job's user
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.hosts_path = self.root / "hosts"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._closed = False

    # -- configuration --------------------------------------------------------------------------
    def node(self, name: str) -> SlurmHost:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} in this cluster ({', '.join(n.name for n in self.nodes)})")

    def slurm_conf(self) -> str:
        r, c = self.root, self.controller
        lines = [
            f"ClusterName=etk{self.tag}",
            f"SlurmctldHost={c.name}({c.addr})",
            "SlurmUser=root", "SlurmdUser=root", "MailProg=/bin/true",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}",
            f"SlurmctldPort={CTLD_PORT}", f"SlurmdPort={SLURMD_PORT}",
            f"StateSaveLocation={r}/ctld", f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/slurmctld.log", f"SlurmdLogFile={r}/slurmd-%n.log",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/linear", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
            "MpiDefault=none", "SwitchType=switch/none",
            "SchedulerType=sched/builtin", "ReturnToService=2", "JobRequeue=1",
            # a requeued job waits cred_expire, then for the main scheduling loop (60 s by
            # default): every second here
            "SchedulerParameters=sched_interval=1",
            # short timeouts: a killed slurmd is noticed in seconds, not minutes
            "SlurmctldTimeout=10", "SlurmdTimeout=10", "MessageTimeout=5", "TCPTimeout=2",
            "KillWait=5", "InactiveLimit=0", "MinJobAge=600", "WaitTime=0",
            "BatchStartTimeout=20", "UnkillableStepTimeout=20",
        ]
        for n in self.nodes:
            lines.append(f"NodeName={n.name} NodeAddr={n.addr} CPUs={self.cpus} State=UNKNOWN")
        lines.append("PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(dict.fromkeys(lines)) + "\n"

    @property
    def env(self) -> dict[str, str]:
        """The environment of a Slurm client of this cluster (``SLURM_CONF`` set, inherited
        ``SLURM_*`` job variables dropped)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def _in(self, host: SlurmHost, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host``: in its network namespace (``nsenter --net``, which keeps
        this mount namespace: ``ip netns exec`` would remount /sys, and slurmd needs the
        cgroup mounts under it), with a host name of its own (a UTS namespace: slurmctld runs
        only where the host name is SlurmctldHost's, and gloo and torch find a node's address
        by its host name) and a mount namespace where the cluster's hosts file is
        ``/etc/hosts``. Every step execs the next: the PID is the program's."""
        pre = [_exe("nsenter"), f"--net=/run/netns/{host.netns}"] if host.netns else []
        return [*pre, _exe("unshare"), "--mount", "--uts", "--propagation", "private", "--",
                "sh", "-c", 'echo "$1" > /proc/sys/kernel/hostname && mount --bind "$0" /etc/hosts '
                '&& shift && exec "$@"', str(self.hosts_path), host.name, *argv]

    def _hosts_file(self) -> str:
        try:
            base = Path("/etc/hosts").read_text()
        except OSError:
            base = "127.0.0.1 localhost\n"
        ours = "".join(f"{h.addr} {h.name}\n" for h in [self.controller, *self.nodes])
        return f"{base.rstrip()}\n# elastictk Slurm test cluster {self.tag}\n{ours}"

    # -- lifetime -------------------------------------------------------------------------------
    def start(self) -> "SlurmCluster":
        """Write the configuration, start munged, slurmctld and every slurmd, and wait until
        every node is idle; :class:`SlurmStartError` (everything stopped) otherwise."""
        try:
            self._configure()
            self._start_munge()
            self._spawn("slurmctld", self.controller, [_exe("slurmctld"), "-D", "-i"])
            self._wait_controller()
            for n in self.nodes:
                self.start_node(n.name, wait=False)
            self.wait_nodes_idle([n.name for n in self.nodes])
        except BaseException:
            self.close()
            raise
        return self

    def _configure(self) -> None:
        (self.root / "ctld").mkdir()
        (self.root / "munge").mkdir(mode=0o700)
        for n in self.nodes:
            (self.root / "spool" / n.name).mkdir(parents=True, mode=0o755)
        self.conf.write_text(self.slurm_conf())
        self.hosts_path.write_text(self._hosts_file())

    def _start_munge(self) -> None:
        m = self.root / "munge"
        key = m / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(1024))
        self._spawn("munged", None, [
            _exe("munged"), "--foreground", "--force", f"--key-file={key}",
            f"--socket={self.munge_socket}", f"--pid-file={m}/munged.pid",
            f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed", "--num-threads=4",
        ], log=m / "munged.log")
        self._wait(lambda: self.munge_socket.exists(), "munged", m / "munged.log")

    def _spawn(self, name: str, host: SlurmHost | None, argv: list[str], log: Path | None = None) -> None:
        env = self.env
        out = open(log or self.root / f"{name}.out", "ab")
        try:
            self._procs[name] = subprocess.Popen(
                self._in(host, argv) if host else argv, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, env=env, close_fds=True, start_new_session=True,
                preexec_fn=dies_with_caller())
        finally:
            out.close()

    def _wait(self, ready: Any, name: str, log: Path) -> None:
        deadline = time.monotonic() + self.start_timeout
        pause = 0.02
        while not ready():
            proc = self._procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise SlurmStartError(f"{name} exited (code {proc.returncode}) while starting: "
                                      f"{_tail(log)}; log: {log}")
            if time.monotonic() > deadline:
                raise SlurmStartError(f"{name} not ready within {self.start_timeout:g}s: "
                                      f"{_tail(log)}; log: {log}")
            time.sleep(pause)
            pause = min(pause * 2, 0.25)

    def _wait_controller(self) -> None:
        self._wait(lambda: self.client(["scontrol", "ping"], check=False).returncode == 0
                   and "UP" in self.client(["scontrol", "ping"], check=False).stdout,
                   "slurmctld", self.root / "slurmctld.log")

    def start_node(self, name: str, wait: bool = True) -> None:
        """Start (or restart) node ``name``'s slurmd; with ``wait``, until Slurm says it is idle."""
        n = self.node(name)
        key = f"slurmd-{name}"
        old = self._procs.get(key)
        if old is not None and old.poll() is None:
            return
        self._spawn(key, n, [_exe("slurmd"), "-D", "-N", name])
        if wait:
            self.wait_nodes_idle([name])

    def kill_node(self, name: str) -> int:
        """SIGKILL node ``name``'s slurmd (a crashed host's daemon); its PID."""
        proc = self._procs[f"slurmd-{name}"]
        proc.kill()
        proc.wait(timeout=30)
        return proc.pid

    def pids_on(self, name: str) -> list[int]:
        """The processes running on node ``name`` now (in its namespace): its slurmd, the
        ``slurmstepd`` of each job step there and the step's tasks."""
        n = self.node(name)
        own = self._procs.get(f"slurmd-{name}")
        return self._namespace_pids([n]) + ([own.pid] if own is not None and own.poll() is None else [])

    def wait_nodes_idle(self, names: Sequence[str], timeout: float | None = None) -> None:
        t = self.start_timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        while True:
            states = {n: self.node_info(n).get("State", "?") for n in names}
            if all(s.split("+")[0] == "IDLE" for s in states.values()):
                return
            for n in names:
                proc = self._procs.get(f"slurmd-{n}")
                if proc is not None and proc.poll() is not None:
                    log = self.root / f"slurmd-{n}.log"
                    raise SlurmStartError(f"slurmd {n} exited (code {proc.returncode}): "
                                          f"{_tail(log)}; log: {log}")
            if time.monotonic() > deadline:
                raise SlurmStartError(f"nodes not idle within {t:g}s: {states}; logs in {self.root}")
            time.sleep(0.2)

    # -- clients --------------------------------------------------------------------------------
    def client(self, argv: Sequence[str], *, check: bool = True, timeout: float = 30,
               env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
               ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client (``sbatch``, ``scontrol``...) on the controller's host."""
        full = {**self.env, **(env or {})}
        done = subprocess.run(self._in(self.controller, argv), capture_output=True, text=True,
                              env=full, timeout=timeout, stdin=subprocess.DEVNULL, cwd=cwd)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: "
                               f"{' '.join((done.stderr or done.stdout).split())[:400]}")
        return done

    def sbatch(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
               cwd: str | os.PathLike[str] | None = None) -> str:
        """Submit a batch job (``sbatch --parsable ARGV``); its job id."""
        out = self.client(["sbatch", "--parsable", *argv], env=env, cwd=cwd).stdout.strip()
        job = out.split(";")[0]
        if not job.isdigit():
            raise RuntimeError(f"sbatch printed {out!r}, not a job id")
        return job

    def show(self, kind: str, name: str) -> dict[str, str]:
        """``scontrol show KIND NAME`` as a dict (``--oneliner``'s Key=Value pairs); empty when
        Slurm does not know it."""
        done = self.client(["scontrol", "--oneliner", "show", kind, name], check=False)
        return parse_show(done.stdout) if done.returncode == 0 else {}

    def node_info(self, name: str) -> dict[str, str]:
        return self.show("node", name)

    def job_info(self, job: str) -> dict[str, str]:
        return self.show("job", job)

    def wait_job(self, job: str, states: Sequence[str], timeout: float) -> dict[str, str]:
        """Poll ``scontrol show job`` until its JobState is one of ``states``; the last record.
        ``TimeoutError`` naming the state it was in."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_info(job)
            if info.get("JobState") in states:
                return info
            time.sleep(0.25)
        raise TimeoutError(f"job {job} not {'/'.join(states)} within {timeout:g}s: "
                           f"{json.dumps(info)[:600]}")

    def jobs(self) -> list[str]:
        done = self.client(["squeue", "--noheader", "--format=%i"], check=False)
        return done.stdout.split() if done.returncode == 0 else []

    # -- teardown -------------------------------------------------------------------------------
    def _namespace_pids(self, hosts: Sequence[SlurmHost]) -> list[int]:
        """Every process in one of ``hosts``' network namespaces (this cluster's: they were made
        for it), the daemons excluded."""
        inodes = set()
        for h in hosts:
            if h.netns:
                try:
                    inodes.add(os.stat(f"/run/netns/{h.netns}").st_ino)
                except OSError:
                    pass
        daemons = {p.pid for p in self._procs.values()}
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in daemons or int(entry) == os.getpid():
                continue
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes:
                    found.append(int(entry))
            except OSError:
                continue
        return found

    @staticmethod
    def _stop(procs: list["subprocess.Popen[bytes]"], grace: float = 10) -> None:
        """SIGTERM each of ``procs``, SIGKILL those still running after ``grace`` seconds."""
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)

    def close(self) -> None:
        """Cancel every job, kill what is left in the cluster's namespaces, stop the daemons (by
        PID), remove the temp dir and hosts files. Idempotent; also after a failed start."""
        if self._closed:
            return
        self._closed = True
        try:
            ctld = self._procs.get("slurmctld")
            if ctld is not None and ctld.poll() is None:
                jobs = self.jobs()
                if jobs:
                    self.client(["scancel", *jobs], check=False)
                    deadline = time.monotonic() + 15
                    while self.jobs() and time.monotonic() < deadline:
                        time.sleep(0.2)
            for pid in self._namespace_pids(self.nodes):  # jobs' processes, not slurmscriptd
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            # the Slurm daemons together, munged (which they ask while stopping) after them
            slurm = [p for k, p in self._procs.items() if k != "munged"]
            self._stop(slurm)
            self._stop([self._procs[k] for k in ("munged",) if k in self._procs])
            for pid in self._namespace_pids([self.controller, *self.nodes]):  # what they left
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


_PAIR = re.compile(r"(\w+)=((?:\([^)]*\)|\S)*)")


def parse_show(text: str) -> dict[str, str]:
    """``scontrol --oneliner show ...``'s first record as Key -> Value (a value ends at the
    next space, except inside parentheses: ``Reason=... [root@...]`` keeps only its first word;
    use :func:`field` for a value that may hold spaces)."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    return {k: v for k, v in _PAIR.findall(first)}


def field(text: str, key: str) -> str | None:
    """The whole value of ``key`` in ``scontrol --oneliner`` output: up to the next `` Key=``."""
    m = re.search(rf"(?:^| ){re.escape(key)}=(.*?)(?= [A-Za-z][A-Za-z:/]*=|$)", text.strip())
    return m.group(1) if m else None


__all__ = ["SlurmCluster", "SlurmHost", "SlurmNotInstalled", "SlurmStartError", "field",
           "missing_binaries", "parse_show"]

"""torchrun's contract with workers and platforms, under ``torchrun`` and ``elastictk-run`` side by side.

What a worker's environment holds (``MASTER_ADDR``/``MASTER_PORT`` and
``TORCHELASTIC_USE_AGENT_STORE`` per backend, ``TORCHELASTIC_SIGNALS_TO_HANDLE``,
``--virtual-local-rank``, no ``TORCH_CPP_LOG_LEVEL`` of the launcher's); a script that opens
``tcp://localhost:MASTER_PORT`` itself, through a restart; a user's ``sitecustomize`` in every
worker; torch's event API (``--event-log-handler``, the launcher's one ``events.record``); a
c10d endpoint held by a silent listener. Unit-level pieces sit at the end.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastictk.store import Endpoint, quiet_port

ROOT = Path(__file__).resolve().parent.parent
LAUNCHERS = {"torchrun": "torch.distributed.run", "elastictk-run": "elastictk.run"}
COMPARED = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_SIGNALS_TO_HANDLE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES",
            "TORCH_CPP_LOG_LEVEL")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "ELASTICTK_", "TORCHELASTIC_", "TORCH_CPP_LOG_LEVEL"))}
    env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra})
    return env


def _run(module: str, argv: list[str], cwd: Path, timeout: float = 180, **env: str
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, env=_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def _worker_envs(out: str) -> dict[str, dict[str, str]]:
    """``[role<local_rank>]:NAME=VALUE`` lines of ``env`` workers, per local rank."""
    envs: dict[str, dict[str, str]] = {}
    for line in out.splitlines():
        m = re.match(r"\[default(\d+)\]:([A-Z_]+)=(.*)$", line)
        if m:
            envs.setdefault(m.group(1), {})[m.group(2)] = m.group(3)
    return envs


def test_workers_environment_equals_torchruns(tmp_path: Path) -> None:
    """Static backend with --master-addr/--master-port, --signals-to-handle, --virtual-local-rank."""
    seen: dict[str, dict[str, dict[str, str | None]]] = {}
    for name, module in LAUNCHERS.items():
        port = quiet_port()
        argv = ["--nnodes", "1", "--master-addr", "localhost", "--master-port", str(port),
                "--nproc-per-node", "2", "--signals-to-handle", "SIGTERM,SIGUSR1",
                "--virtual-local-rank", "--tee", "1", "--no-python", "/usr/bin/env"]
        proc = _run(module, argv, tmp_path, CUDA_VISIBLE_DEVICES="3,5")
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        envs = _worker_envs(proc.stdout)
        assert sorted(envs) == ["0", "1"], (name, proc.stdout[-2000:])
        for env in envs.values():  # the port differs per launcher: stands for "the master port"
            assert env.get("MASTER_PORT") == str(port), (name, env.get("MASTER_PORT"), port)
            env["MASTER_PORT"] = "P"
        seen[name] = {lr: {k: env.get(k) for k in COMPARED} for lr, env in envs.items()}
    theirs = seen["torchrun"]
    assert theirs["1"] == {"MASTER_ADDR": "localhost", "MASTER_PORT": "P",
                           "TORCHELASTIC_USE_AGENT_STORE": "True",
                           "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGUSR1", "LOCAL_RANK": "0",
                           "CUDA_VISIBLE_DEVICES": "5", "TORCH_CPP_LOG_LEVEL": None}
    assert seen["elastictk-run"] == theirs


PG_SCRIPT = '''
import os, sys
import torch, torch.distributed as dist
port = int(sys.argv[1])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method=f"tcp://localhost:{port}", rank=rank, world_size=world)
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(os.path.join(sys.argv[2], f"{rank}-{attempt}"), "w") as f:
    f.write(str(int(t.item())))
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and rank == 1:
    sys.exit(3)
dist.destroy_process_group()
'''


def test_a_script_opening_tcp_localhost_master_port_runs_and_restarts(tmp_path: Path) -> None:
    """torchrun hosts the store on --master-port and workers connect to it as clients; a
    script opening ``tcp://localhost:P`` itself must not find the port taken (EADDRINUSE),
    and after a restart the new group must not read the old group's keys."""
    (tmp_path / "pg.py").write_text(PG_SCRIPT)
    (tmp_path / "sums").mkdir()
    port = quiet_port()
    proc = _run("elastictk.run", ["--nnodes", "1", "--master-addr", "localhost", "--master-port",
                                  str(port), "--nproc-per-node", "2", "--max-restarts", "1",
                                  "pg.py", str(port), str(tmp_path / "sums")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sums = {p.name: p.read_text() for p in (tmp_path / "sums").iterdir()}
    assert sums == {"0-0": "3", "1-0": "3", "0-1": "3", "1-1": "3"}, proc.stderr[-3000:]


USER_SITE = '''
import os
marks = os.environ.get("USER_SITE_MARKS")
if marks:
    open(os.path.join(marks, f"{os.getpid()}-{os.environ.get('RANK', 'none')}"), "w").close()
'''


@pytest.mark.parametrize("start", [[], ["--start-method", "spawn"]], ids=["preload", "spawn"])
def test_a_user_sitecustomize_runs_in_every_worker(tmp_path: Path, start: list[str]) -> None:
    site, marks = tmp_path / "site", tmp_path / "marks"
    site.mkdir()
    marks.mkdir()
    (site / "sitecustomize.py").write_text(USER_SITE)
    (tmp_path / "w.py").write_text("print('ran')\n")
    proc = _run("elastictk.run", ["--standalone", "--nproc-per-node", "2", *start, "w.py"],
                tmp_path, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]),
                USER_SITE_MARKS=str(marks))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = sorted(p.name.split("-")[1] for p in marks.iterdir())
    assert ranks.count("0") == 1 and ranks.count("1") == 1, ranks


def _events(err: str) -> list[tuple[str, str, Any]]:
    """(name, source, state) of torch's console handler's lines: one JSON event each."""
    out = []
    for line in err.splitlines():
        start = line.find('{"name": "torchelastic')
        if start >= 0:
            e = json.loads(line[start:])
            out.append((e["name"], e["source"], e["metadata"]["global_rank"]))
    return out


def test_event_log_handler_console_gets_torchruns_events(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("print('ok')\n")
    seen = {}
    for name, module in LAUNCHERS.items():
        proc = _run(module, ["--standalone", "--nproc-per-node", "2", "--event-log-handler",
                             "console", "ok.py"], tmp_path)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        seen[name] = sorted(_events(proc.stderr), key=str)
    assert seen["torchrun"], "torchrun printed no event: the comparison would be empty"
    assert seen["elastictk-run"] == seen["torchrun"]


CALLER = '''
import sys
from unittest import mock
which, argv = sys.argv[1], sys.argv[2:]
if which == "torchrun":
    from torch.distributed.run import main
else:
    from elastictk.run import main
with mock.patch("torch.distributed.elastic.events.record") as record:
    try:
        main(argv)
    except Exception as e:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        print("RAISED", "ChildFailedError" if isinstance(e, ChildFailedError) else repr(e))
print("CALLS", record.call_count, [c.args[0].name for c in record.call_args_list])
'''


def test_the_launchers_one_events_record_call_on_a_failed_job(tmp_path: Path) -> None:
    """torch's test_launch_elastic_worker_raise_exception, for both ``main`` functions."""
    (tmp_path / "caller.py").write_text(CALLER)
    (tmp_path / "fail.py").write_text("import sys\nsys.exit(1)\n")
    seen = {}
    for name in LAUNCHERS:
        proc = subprocess.run([sys.executable, "caller.py", name, "--standalone",
                               "--nproc-per-node", "2", "--start-method", "spawn", "fail.py"],
                              cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180)
        seen[name] = [ln for ln in proc.stdout.splitlines() if ln.startswith(("RAISED", "CALLS"))]
    assert seen["torchrun"] == ["RAISED ChildFailedError",
                                "CALLS 1 ['torchelastic.worker.status.SUCCEEDED']"]
    assert seen["elastictk-run"] == seen["torchrun"]


@pytest.fixture
def silent_listener() -> Any:
    """A socket on 127.0.0.1 that accepts connections (the kernel does) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def test_a_c10d_endpoint_held_by_a_silent_listener_fails_in_one_line(
        tmp_path: Path, silent_listener: int) -> None:
    (tmp_path / "ok.py").write_text("print('ok')\n")
    endpoint = f"127.0.0.1:{silent_listener}"
    # No wall-clock bound (a loaded host starts Python slowly): the evidence that our ping ended
    # it, not torch's client and its longer timeout, is the ping's own line; the run's timeout
    # is only the guard against a hang.
    proc = _run("elastictk.run", ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                  endpoint, "ok.py"], tmp_path, timeout=240)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and endpoint in errors[0] and "TCPStore" in errors[0], proc.stderr
    assert "sent no TCPStore answer within 5s" in errors[0], errors[0]
    assert "Traceback" not in proc.stderr


# --- unit level ----------------------------------------------------------------------------


def test_ping_store_tells_a_tcpstore_from_a_silent_listener(silent_listener: int) -> None:
    from elastictk.store.listen import ping_store
    from elastictk.store.tcp import TCPStore

    server = TCPStore.serve("127.0.0.1", 0)
    try:
        assert ping_store(Endpoint("127.0.0.1", server.port), 5.0) is None
    finally:
        server.close()
    start = time.monotonic()
    reason = ping_store(Endpoint("127.0.0.1", silent_listener), 1.0)
    assert reason is not None and "no TCPStore answer within 1s" in reason, reason
    assert time.monotonic() - start < 60  # a hang guard only: the line above says the deadline ended it
    closed = quiet_port()
    assert "refused" in (ping_store(Endpoint("127.0.0.1", closed), 1.0) or "")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(answer=st.binary(max_size=64), close=st.booleans())
def test_ping_store_reads_any_answer_without_raising(answer: bytes, close: bool) -> None:
    """Whatever a listener sends back (short, long, garbage, then closing or not), the probe
    returns a reason, and ``None`` only for the store's own echo of the nonce."""
    from elastictk.store.listen import ping_store

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(64)
            conn.sendall(answer)
            if not close:
                time.sleep(0.3)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        reason = ping_store(Endpoint("127.0.0.1", srv.getsockname()[1]), 0.2)
    finally:
        t.join(5)
        srv.close()
    assert reason is not None and reason.strip() and "\n" not in reason


def test_a_hosted_store_listens_where_it_is_told() -> None:
    import psutil

    from elastictk.store.tcp import TCPStore

    def listening() -> set[tuple[str, int]]:
        return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp")
                if c.status == psutil.CONN_LISTEN}

    loop = TCPStore.serve("localhost", 0)
    anywhere = TCPStore.serve("127.0.0.1", 0, listen="::")
    try:
        now = listening()
        assert ("127.0.0.1", loop.port) in now
        assert ("::", anywhere.port) in now or ("0.0.0.0", anywhere.port) in now
    finally:
        loop.close()
        anywhere.close()


def test_listen_address_per_endpoint() -> None:
    from elastictk.rendezvous.backends import listen_address

    assert listen_address("localhost", single_node=True) == "127.0.0.1"
    assert listen_address("127.0.0.1", single_node=False) == "127.0.0.1"  # peers dial it as is
    assert listen_address("localhost", single_node=False) == "::"  # a name peers resolve elsewhere
    assert listen_address("localhost", single_node=False, local_addr="10.1.2.3") == "10.1.2.3"
    assert listen_address("0.0.0.0", single_node=True) == "0.0.0.0"
    assert listen_address("192.0.2.7", single_node=False) == "::"  # not this machine's (NAT/VIP)


def test_workers_store_per_backend_and_forgetting_the_last_attempts_keys() -> None:
    from elastictk.agent.master import WorkersStore, forget_workers
    from elastictk.store import FileStore

    assert WorkersStore.for_backend("static", ("localhost", 29500)).fixed == ("localhost", 29500)
    assert WorkersStore.for_backend("c10d", None, environ={}).use_agent_store
    off = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert not WorkersStore.for_backend("c10d", None, environ=off).use_agent_store
    assert not WorkersStore.for_backend("etcd", None, environ={}).use_agent_store
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        store = FileStore(d)
        for key in ("default_pg/0//cpu//0/0", "default_pg/0//cpu//0/1", "rdzv/job/x"):
            store.set(key, b"1")
        assert forget_workers(store) == 2
        assert store.keys() == ["rdzv/job/x"]
        store.close()


def test_virtual_devices_as_torch() -> None:
    from elastictk.supervisor.env import AssignmentError, slot_rank, virtual_devices

    assert virtual_devices(1, "3,5") == {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "5",
                                         "ELASTICTK_LOCAL_RANK": "1"}
    assert virtual_devices(2, None)["CUDA_VISIBLE_DEVICES"] == "2"
    with pytest.raises(AssignmentError, match="exceeds available GPUs"):
        virtual_devices(2, "3,5")
    assert slot_rank(virtual_devices(1, None)) == 1
    assert slot_rank({"LOCAL_RANK": "2"}) == 2


def test_bad_event_handler_and_too_few_devices_are_usage_errors(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("")
    for argv, env, needle in (
            (["--event-log-handler", "nosuch"], {}, "no torch event handler of that name"),
            (["--virtual-local-rank", "--nproc-per-node", "3"], {"CUDA_VISIBLE_DEVICES": "0,1"},
             "CUDA_VISIBLE_DEVICES='0,1', which lists fewer")):
        proc = _run("elastictk.run", ["--standalone", *argv, "ok.py"], tmp_path, timeout=60, **env)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], proc.stderr

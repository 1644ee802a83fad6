"""Suite-wide guards: every test must leave no process, shared-memory segment or port behind."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Iterator

import psutil
import pytest

from tests.helpers.procs import cmdline

# Python's own multiprocessing helper lives for the whole session by design.
_EXEMPT = ("multiprocessing.resource_tracker",)
# Servers owned by session-scoped fixtures (reaped at session end, not per test).
SESSION_PIDS: set[int] = set()


def pytest_configure(config: pytest.Config) -> None:
    """A private base temp dir per run: pytest runs that share /tmp/pytest-of-<user> delete
    each other's numbered dirs, so two runs on one machine would break each other's tests.

    And a private ``TMPDIR`` for everything the tests start (set once, by the process that
    starts the others: pytest-xdist's workers inherit it): an ``elastictk-run`` without
    ``--log-dir`` makes its log directory there, as torchrun makes ``/tmp/torchelastic_*``,
    and it goes with the run instead of piling up in /tmp (hundreds per run)."""
    if config.option.basetemp is None:
        config.option.basetemp = tempfile.mkdtemp(prefix="elastictk-tests-")
        config.stash[_OWN_BASETEMP] = config.option.basetemp
    if not hasattr(config, "workerinput"):
        tmp = tempfile.mkdtemp(prefix="elastictk-tmp-")
        config.stash[_OWN_TMPDIR] = tmp
        os.environ["TMPDIR"] = tmp


def pytest_unconfigure(config: pytest.Config) -> None:
    for key in (_OWN_BASETEMP, _OWN_TMPDIR):
        own = config.stash.get(key, None)
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)


_OWN_BASETEMP = pytest.StashKey[str]()
_OWN_TMPDIR = pytest.StashKey[str]()


def _children() -> dict[int, str]:
    out: dict[int, str] = {}
    for p in psutil.Process().children(recursive=True):
        cmd = cmdline(p)
        if not cmd:  # ended (or a zombie) between the listing and the read
            continue
        if p.pid not in SESSION_PIDS and not any(e in cmd for e in _EXEMPT):
            out[p.pid] = cmd
    return out


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def _held_by_others(names: set[str]) -> set[str]:
    """The segments among ``names`` that a live process outside this test run has open or
    mapped: another test run's on a shared machine, not a leak of ours (and not ours to
    unlink). Segments nobody holds are judged leaked, as before."""
    if not names:
        return set()
    mine = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    paths = {f"/dev/shm/{n}": n for n in names}
    held: set[str] = set()
    for pid in psutil.pids():
        if pid in mine:
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target in paths:
                    held.add(paths[target])
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.rstrip("\n").split(maxsplit=5)[-1]
                    if path in paths:
                        held.add(paths[path])
        except OSError:
            continue
    return held


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a child process or a /dev/shm segment behind (and reap them)."""
    before_procs, before_shm = set(_children()), _shm()
    yield
    deadline = time.monotonic() + 5
    leaked = {}
    while time.monotonic() < deadline:
        leaked = {pid: cmd for pid, cmd in _children().items() if pid not in before_procs}
        if not leaked:
            break
        time.sleep(0.05)
    for pid in leaked:  # only processes this test started, by PID
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    new_shm = {s for s in _shm() - before_shm if s.startswith(("elastictk", "etk", "faketime_shm", "sem.faketime"))}
    new_shm -= _held_by_others(new_shm)
    for name in new_shm:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass
    problems = [f"leaked process {pid}: {cmd[:200]}" for pid, cmd in leaked.items()]
    problems += [f"leaked shared memory /dev/shm/{n}" for n in sorted(new_shm)]
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


from elastictk.testing.etcd import EtcdNotInstalled, EtcdServer  # noqa: E402


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd for the whole session (skipped, with the install hint, when etcd is missing).

    Tests share it safely by using a fresh key prefix each; a test that stops or restarts etcd
    starts its own EtcdServer instead.
    """
    try:
        server = EtcdServer(base_dir=tmp_path_factory.mktemp("etcd"))
    except EtcdNotInstalled as e:
        pytest.skip(str(e))
    with server:
        if server.pid is not None:
            SESSION_PIDS.add(server.pid)
        yield server

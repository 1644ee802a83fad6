"""FileStore: the contract, many processes at once, and participants SIGKILLed mid-operation."""
from __future__ import annotations

import fcntl
import hashlib
import gc
import os
import pickle
import random
import select
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from elastictk.store import FileStore, StoreClosed, StoreError, StoreTimeout
from elastictk.store import file as file_mod
from elastictk.store._inotify import IN_MOVED_TO, open_watch
from elastictk.store.filekeys import key_file, lock_stripe
from elastictk.store.filesafe import TEMP_MAX_AGE
from tests.helpers.store_contract import StoreContract

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FileStore]:
    s = FileStore(tmp_path / "store", timeout=10)
    yield s
    s.close()


class TestFileStoreContract(StoreContract):
    pass


class TestPollingOnly(StoreContract):
    """The path taken on NFS, where inotify does not see other hosts' writes."""

    model_examples = 5

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[FileStore]:
        s = FileStore(tmp_path / "store", timeout=10, watch=False, durable=False)
        yield s
        s.close()


def _spawn(code: str, *args: str, **kw: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw,  # type: ignore[arg-type]
    )


def _finish(procs: list[subprocess.Popen[bytes]], timeout: float = 60) -> None:
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err.decode()[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# -- layout, modes, errors ------------------------------------------------------------------
def test_describe_and_created_dir_mode(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b"
    with FileStore(path) as s:
        assert s.describe() == f"file://{path}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_key_and_lock_files_are_private(store: FileStore) -> None:
    store.set("dir/secret", b"x")
    store.add("ctr", 1)
    files = [f for f in Path(store.path).iterdir()]
    assert any(f.name.startswith("k.") for f in files)
    assert any(f.name.startswith("lock.") for f in files)
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f.name


@pytest.mark.parametrize("key", ["a/b/../c", "..", ".", "%2F", "ü/\u2603", "", "x" * 1000,
                                 "é" * 300, "sp ace\nnl", "/leading"])
def test_awkward_keys_round_trip(store: FileStore, key: str) -> None:
    assert store.try_get(key) is None
    store.set(key, b"v")
    assert store.try_get(key) == b"v"
    assert key in store.keys()
    assert store.keys(key) == [key] or key == ""
    assert store.add(key + "#n", 2) == 2
    assert store.compare_set(key, b"v", b"w") == b"w"
    assert store.delete(key) is True
    assert store.try_get(key) is None
    assert store.keys(key) == ([key + "#n"] if key else store.keys())


def test_long_key_prefix_listing(store: FileStore) -> None:
    long_a, long_b = "job/" + "a" * 500, "other/" + "b" * 500
    store.set(long_a, b"1")
    store.set(long_b, b"2")
    store.set("job/short", b"3")
    assert sorted(store.keys("job/")) == sorted([long_a, "job/short"])
    assert store.multi_get([long_a, long_b]) == [b"1", b"2"]


def test_compare_set_empty_expected_matches_absent_and_empty(store: FileStore) -> None:
    assert store.compare_set("k", None, b"1") == b"1"
    assert store.compare_set("k", b"", b"2") is not None and store.try_get("k") == b"1"
    store.set("e", b"")
    assert store.compare_set("e", None, b"x") == b"x"
    assert store.compare_set("absent", b"something", b"x") is None
    assert store.try_get("absent") is None


def test_add_on_a_non_counter_names_the_key(store: FileStore) -> None:
    store.set("word", b"hello")
    with pytest.raises(StoreError, match="'word'.*not a decimal counter"):
        store.add("word", 1)
    assert store.try_get("word") == b"hello"


def test_path_that_is_a_file_gives_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "plain"
    blocker.write_text("not a dir")
    for path in (blocker, blocker / "sub"):
        with pytest.raises(StoreError) as e:
            FileStore(path)
        msg = str(e.value)
        assert str(path) in msg and "not a directory" in msg and "\n" not in msg


def _error_as_nobody(path: Path) -> str:
    """Open a FileStore at ``path`` in a forked child that dropped root to user nobody."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                FileStore(path).close()
                os.write(w, b"no error")
            except StoreError as e:
                os.write(w, str(e).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            msg = f.read().decode()
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return msg


def test_path_without_permission_gives_one_line(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)  # only the owner may enter; no one but root may create inside
    target = locked / "store"
    try:
        if os.geteuid() == 0:  # root passes every permission check: ask an unprivileged user
            msg = _error_as_nobody(target)
        else:
            with pytest.raises(StoreError) as e:
                FileStore(target)
            msg = str(e.value)
    finally:
        locked.chmod(0o700)
    assert str(target) in msg and "permission denied" in msg and "\n" not in msg


def test_closed_store_refuses_and_close_releases_fds(tmp_path: Path) -> None:
    # The set, not the count: an object an earlier test left to the garbage collector may
    # close one of its fds meanwhile; what matters is that no fd of this store stays open.
    gc.collect()
    before = set(os.listdir("/proc/self/fd"))
    s = FileStore(tmp_path)
    s.set("k", b"v")
    with pytest.raises(Exception):
        s.get("missing", timeout=0.05)  # opens the inotify watch
    c = s.clone()
    assert c.try_get("k") == b"v"
    s.close()
    s.close()
    c.close()
    with pytest.raises(StoreClosed):
        s.try_get("k")
    with pytest.raises(StoreClosed):
        s.clone()
    assert set(os.listdir("/proc/self/fd")) <= before


def test_a_held_lock_times_out_naming_the_key(store: FileStore) -> None:
    """A participant stopped while holding a lock gives an error, not a hang."""
    short = FileStore(store.path, timeout=0.3)
    fd = os.open(Path(store.path) / f"lock.{lock_stripe('held'):02d}", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file description: it conflicts
        with pytest.raises(StoreTimeout, match="lock on key 'held'"):
            short.add("held", 1)
        assert short.try_get("held") is None  # reads need no lock
    finally:
        os.close(fd)
        short.close()
    assert store.add("held", 1) == 1


def test_pickles_as_its_path(store: FileStore) -> None:
    store.set("k", b"v")
    copy = pickle.loads(pickle.dumps(store))
    try:
        assert copy.describe() == store.describe() and copy.try_get("k") == b"v"
    finally:
        copy.close()


def test_leftover_temp_files_are_invisible_and_collected(store: FileStore) -> None:
    root = Path(store.path)
    stale, fresh = root / "t.999999.dead", root / "t.999999.live"
    for f in (stale, fresh):
        f.write_bytes(b"partial")
    old = time.time() - 10 * TEMP_MAX_AGE
    os.utime(stale, (old, old))
    assert store.keys() == []
    with FileStore(store.path) as again:
        assert again.keys() == []
    assert not stale.exists()
    assert fresh.exists()  # may belong to a writer that is still running


# -- an untrusted directory: planted files, loose permissions, durability -------------------------
def _get_in_thread(store: FileStore, key: str, fifo: Path | None = None) -> BaseException | bytes:
    """``store.get(key)`` in a thread that must finish within a couple of seconds; a hung
    ``open`` of a FIFO is released (a writer opens and closes it) so the test cannot hang."""
    result: list[BaseException | bytes] = []

    def run() -> None:
        try:
            result.append(store.get(key, timeout=5))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result.append(e)

    t = threading.Thread(target=run, name="test-store-get", daemon=True)
    start = time.monotonic()
    t.start()
    t.join(timeout=3)
    hung = t.is_alive()
    if hung and fifo is not None:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # a reader waits: this opens at once
        os.close(fd)
    t.join(timeout=30)
    assert not hung, "get hung on a planted file"
    assert time.monotonic() - start < 2.5
    return result[0]


@pytest.mark.parametrize("plant", ["fifo", "symlink", "directory", "device"])
def test_a_non_regular_file_planted_as_a_key_is_a_clear_error(
        store: FileStore, tmp_path: Path, plant: str) -> None:
    target = Path(store.path) / key_file("rank/0")
    outside = tmp_path / "outside"
    outside.write_bytes(b"not the store's")
    if plant == "fifo":
        os.mkfifo(target, 0o600)
    elif plant == "symlink":
        target.symlink_to(outside)
    elif plant == "directory":
        target.mkdir()
    else:
        if os.geteuid() != 0:
            pytest.skip("mknod of a device needs root")
        os.mknod(target, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    got = _get_in_thread(store, "rank/0", target if plant == "fifo" else None)
    assert isinstance(got, StoreError), got
    msg = str(got)
    kind = {"fifo": "a FIFO", "symlink": "a symlink", "directory": "a directory", "device": "a device"}[plant]
    assert kind in msg and "'rank/0'" in msg and store.path in msg and "remove it" in msg and "\n" not in msg
    with pytest.raises(StoreError, match=kind):
        store.try_get("rank/0")
    assert outside.read_bytes() == b"not the store's"
    store.set("other", b"fine")  # the rest of the store still works
    assert store.get("other") == b"fine"


def test_a_symlink_planted_as_a_lock_file_is_refused(store: FileStore, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"")
    (Path(store.path) / f"lock.{lock_stripe('k'):02d}").symlink_to(victim)
    with pytest.raises(StoreError, match="a symlink"):
        store.set("k", b"v")
    assert store.try_get("k") is None


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777], ids=oct)
def test_a_dir_writable_by_group_or_others_is_refused(tmp_path: Path, mode: int) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(StoreError) as e:
        FileStore(shared)
    msg = str(e.value)
    assert str(shared) in msg and "writable by group or others" in msg
    # a shared sticky directory (/tmp) is never to be made unwritable for everyone: a subdirectory
    assert ("private subdirectory" in msg) if mode & 0o1000 else ("chmod go-w" in msg), msg
    assert "\n" not in msg
    assert len(os.listdir("/proc/self/fd")) == before
    assert os.listdir(shared) == []  # refused before it wrote anything
    shared.chmod(0o750)
    FileStore(shared).close()  # readable by the group is fine


def test_a_dir_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    """Root, which passes every permission check, refuses a directory user nobody made itself
    (``setpriv``: a real second user, so the owner is whoever created it, as on a shared host)."""
    if os.geteuid() != 0:
        pytest.skip("running a command as another user needs root (see the test below for any user)")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    # Started in ``shared``: nobody makes ``theirs`` there without traversing root's temp dirs.
    subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                    "mkdir", "-m", "0700", "theirs"], cwd=shared, check=True, timeout=30)
    theirs = shared / "theirs"
    assert theirs.stat().st_uid == 65534
    with pytest.raises(StoreError) as e:
        FileStore(theirs)
    msg = str(e.value)
    assert str(theirs) in msg and "owned by user id 65534" in msg and "\n" not in msg
    assert os.listdir(theirs) == []  # refused before it wrote anything


def test_a_dir_owned_by_another_user_is_refused_whoever_runs_it() -> None:
    """The owner check for any user: ``/`` belongs to root (its mode lets no group or other
    write, so only the owner check can name it). Run as root, user nobody (a forked child that
    dropped root) opens it; otherwise the test's own user does."""
    top = Path("/")
    st = top.stat()
    assert not stat.S_IMODE(st.st_mode) & (stat.S_IWGRP | stat.S_IWOTH)
    if os.geteuid() == 0:
        assert st.st_uid != 65534
        msg = _error_as_nobody(top)
    elif st.st_uid == os.geteuid():
        pytest.skip("this user owns / (a container of its own): no directory of another user to open")
    else:
        with pytest.raises(StoreError) as e:
            FileStore(top)
        msg = str(e.value)
    assert f"owned by user id {st.st_uid}" in msg and "not by the current user" in msg, msg
    assert "\n" not in msg


def test_a_dir_the_store_creates_passes_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        with FileStore(tmp_path / "new" / "store") as s:
            s.set("k", b"v")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new" / "store").stat().st_mode) == 0o700


def _record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record, in order, each fsync (of a directory or a file) and each rename by the store."""
    calls: list[str] = []
    real_fsync, real_replace = file_mod.os.fsync, file_mod.os.replace

    def fsync(fd: int) -> None:
        calls.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(*args: object, **kw: object) -> None:
        calls.append("rename")
        real_replace(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(file_mod.os, "fsync", fsync)
    monkeypatch.setattr(file_mod.os, "replace", replace)
    return calls


def test_a_durable_write_fsyncs_the_directory_after_the_rename(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with FileStore(tmp_path / "d") as s:
        calls = _record_fsyncs(monkeypatch)
        s.set("k", b"v")
        assert calls == ["fsync file", "rename", "fsync dir"]
        calls.clear()
        s.add("n", 1)
        assert calls == ["fsync file", "rename", "fsync dir"]
        calls.clear()
        assert s.delete("k")
        assert calls == ["fsync dir"]
        monkeypatch.undo()
    with FileStore(tmp_path / "nd", durable=False) as fast:
        calls = _record_fsyncs(monkeypatch)
        fast.set("k", b"v")
        assert calls == ["rename"]


def test_inotify_watch_sees_a_rename(tmp_path: Path) -> None:
    watch = open_watch(str(tmp_path), IN_MOVED_TO)
    if watch is None:
        pytest.skip("inotify unavailable here")
    try:
        assert not watch.wait(0)
        (tmp_path / "tmp").write_bytes(b"")
        assert not watch.wait(0)  # creating a file is not a rename
        os.replace(tmp_path / "tmp", tmp_path / "done")
        assert watch.wait(10)
        watch.drain()
        assert not watch.wait(0)
    finally:
        watch.close()


# -- many processes ---------------------------------------------------------------------------
CONTENDER = """
    import sys
    from elastictk.store import FileStore
    s = FileStore(sys.argv[1], timeout=60, durable=False)
    n_procs, rounds = int(sys.argv[2]), int(sys.argv[3])
    if s.add("started", 1) == n_procs:
        s.set("go", b"1")
    s.get("go")
    for i in range(rounds):
        s.add("ctr/a", 1)
        s.add("ctr/b", 3)
        s.add("own/" + sys.argv[4], 1)  # a key of its own: other lock stripes stay busy too
        while True:  # increment through compare_set, the way rendezvous updates its state
            cur = s.try_get("cas")
            # a value only this attempt writes: compare_set also answers ``desired`` when
            # someone else already stored it, so an increment must not be a bare count
            new = b"%d:%s:%d" % (int((cur or b"0").split(b":")[0]) + 1, sys.argv[4].encode(), i)
            if s.compare_set("cas", cur, new) == new:
                break
    s.close()
"""


def test_eight_processes_lose_no_update(tmp_path: Path) -> None:
    n, rounds = 8, 40
    procs = [_spawn(CONTENDER, str(tmp_path), str(n), str(rounds), str(i)) for i in range(n)]
    _finish(procs)
    with FileStore(tmp_path) as s:
        assert s.get("ctr/a") == str(n * rounds).encode()
        assert s.get("ctr/b") == str(3 * n * rounds).encode()
        assert s.get("cas").split(b":")[0] == str(n * rounds).encode()
        assert all(s.get(f"own/{i}") == str(rounds).encode() for i in range(n))


# -- crash safety -----------------------------------------------------------------------------
CRASHER = """
    import hashlib, os, random, sys
    from elastictk.store import FileStore
    s = FileStore(sys.argv[1], timeout=30)
    log = os.open(sys.argv[2], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    rng = random.Random(int(sys.argv[3]))
    print("up", flush=True)
    while True:
        op, i = rng.randrange(3), rng.randrange(4)
        if op == 0:
            payload = os.urandom(rng.randrange(1, 20000))
            s.set(f"val/{i}", payload + hashlib.sha256(payload).digest())
        elif op == 1:
            os.write(log, f"try add/{i}\\n".encode())
            s.add(f"add/{i}", 1)
            os.write(log, f"ack add/{i}\\n".encode())
        else:
            os.write(log, f"try cas/{i}\\n".encode())
            while True:
                cur = s.try_get(f"cas/{i}")
                count = int((cur or b"0").split(b":")[0]) + 1
                new = b"%d:%d:%s" % (count, os.getpid(), os.urandom(8).hex().encode())
                if s.compare_set(f"cas/{i}", cur, new) == new:
                    break
            os.write(log, f"ack cas/{i}\\n".encode())
"""

FRESH = """
    import sys
    from elastictk.store import FileStore
    from elastictk.store.filekeys import LOCK_STRIPES, lock_stripe
    s = FileStore(sys.argv[1], timeout=5)
    by_stripe = {}
    i = 0
    while len(by_stripe) < LOCK_STRIPES:
        by_stripe.setdefault(lock_stripe(f"probe/{i}"), f"probe/{i}")
        i += 1
    for key in by_stripe.values():  # every lock stripe is free
        s.set(key, b"1")
        assert s.add(key + "/n", 1) == 1
        assert s.compare_set(key, b"1", b"2") == b"2"
        assert s.get(key) == b"2"
        assert s.delete(key)
    s.wait(["val/0"])
    print("ok")
"""


def _tally(logs: list[Path]) -> tuple[dict[str, int], dict[str, int]]:
    tried: dict[str, int] = {}
    acked: dict[str, int] = {}
    for log in logs:
        for line in log.read_bytes().split(b"\n")[:-1]:  # a line cut by SIGKILL has no "\n"
            kind, _, key = line.decode().partition(" ")
            if kind in ("try", "ack"):
                target = tried if kind == "try" else acked
                target[key] = target.get(key, 0) + 1
    return tried, acked


def test_sigkill_at_random_moments_tears_and_loses_nothing(tmp_path: Path) -> None:
    root, logs_dir = tmp_path / "store", tmp_path / "logs"
    logs_dir.mkdir()
    FileStore(root).close()
    rng = random.Random(1234)
    logs: list[Path] = []
    live: list[subprocess.Popen[bytes]] = []
    kills = 0

    def start() -> None:
        log = logs_dir / f"{len(logs)}.log"
        logs.append(log)
        p = _spawn(CRASHER, str(root), str(log), str(len(logs)))
        live.append(p)
        assert p.stdout is not None and p.stderr is not None
        ready, _, _ = select.select([p.stdout], [], [], 60)  # it is in its loop from here on
        assert ready and p.stdout.readline() == b"up\n", p.stderr.read().decode()[-2000:]

    try:
        for _ in range(3):
            start()
        while kills < 15:
            time.sleep(rng.uniform(0.02, 0.3))
            victim = live.pop(rng.randrange(len(live)))
            assert victim.poll() is None, victim.communicate()[1].decode()[-2000:]
            os.kill(victim.pid, signal.SIGKILL)
            victim.communicate(timeout=30)
            kills += 1
            start()
    finally:
        for p in live:
            p.kill()
            p.communicate(timeout=30)

    tried, acked = _tally(logs)
    assert sum(acked.values()) > 0
    with FileStore(root, timeout=5) as s:
        stored = s.keys()
        assert {k.split("/")[0] for k in stored} <= {"val", "add", "cas"}  # no temp file shows
        counts: dict[str, int] = {}
        for key in stored:
            value = s.try_get(key)
            assert value is not None
            if key.startswith("val/"):
                payload, digest = value[:-32], value[-32:]
                assert hashlib.sha256(payload).digest() == digest, f"torn value under {key}"
            else:
                counts[key] = int(value.split(b":")[0])
    for key in set(tried) | set(counts):
        assert acked.get(key, 0) <= counts.get(key, 0) <= tried.get(key, 0), key

    fresh = _spawn(FRESH, str(root))
    _finish([fresh], timeout=60)

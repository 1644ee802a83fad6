"""Timer semantics as properties: the shared-memory word format, the client's slots under any
sequence of acquire/release/re-acquire, and reading faulthandler dumps.

The client runs in this process, attached to a real region of a real ``TimerServer`` (which
watches nothing, so nothing is ever reaped); the test reads the region through its own mapping
of the agent's file, exactly as the reaper does.
"""
from __future__ import annotations

import mmap
import os
import time
from typing import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk import timer
from elastictk.timer import Expiry, TimerError, TimerServer
from elastictk.timer import layout as L
from elastictk.timer.boot import SITE_DIR, worker_env
from elastictk.timer.stacks import Frame, ThreadStack, culprit, parse

SCOPES = ["all_reduce", "barrier", "step", "load", "ünïcode scope"]


@given(st.integers(min_value=0, max_value=1 << 60), st.integers(0, 10**18),
       st.integers(0, L.SCOPE_MASK))
def test_a_word_holds_the_deadline_and_the_scope(now: int, after: int, sid: int) -> None:
    word = L.arm(now, L.timer_constant(after, sid))
    assert word != 0 and 0 <= word < 1 << 64
    deadline, got_sid = L.decode(word)
    assert got_sid == sid
    # never early, at most two 65.5 µs steps late
    assert now + after <= deadline <= now + after + 2 * (1 << L.SCOPE_BITS)


@given(st.lists(st.text(max_size=300), max_size=30))
def test_the_scope_table_decodes_what_was_written(names: list[str]) -> None:
    raw = b"".join(L.encode_scope(n) for n in names)
    decoded = L.decode_table(raw)
    assert len(decoded) == len(names)
    for name, got in zip(names, decoded):
        assert len(got.encode()) <= L.MAX_SCOPE_BYTES
        if len(name.encode()) <= L.MAX_SCOPE_BYTES:
            assert got == name.replace("\n", " ")
    assert L.decode_table(raw + b"partial entr") == decoded  # an entry being written is unseen


@pytest.fixture(scope="module")
def region() -> Iterator[tuple[TimerServer, mmap.mmap]]:
    srv = TimerServer(1)
    fd = os.open(srv.path, os.O_RDONLY)
    view = mmap.mmap(fd, L.REGION_SIZE, prot=mmap.PROT_READ)
    os.close(fd)
    timer.detach()
    try:
        yield srv, view
    finally:
        timer.detach()
        view.close()
        srv.close()


def armed(view: mmap.mmap) -> dict[int, int]:
    """Slot offset -> word of every armed slot, as the reaper reads them."""
    words = L.SLOT_ARRAY.unpack_from(view, L.SLOTS_OFFSET)
    return {L.SLOTS_OFFSET + 8 * i: w for i, w in enumerate(words) if w}


def scope_names(view: mmap.mmap) -> list[str]:
    n = L.U64.unpack_from(view, L.OFF_TABLE_LEN)[0]
    return L.decode_table(bytes(view[L.TABLE_OFFSET:L.TABLE_OFFSET + n]))


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("acquire"), st.floats(0, 1e4), st.sampled_from(SCOPES)),
        st.tuples(st.just("release"), st.integers(0, 50)),
        st.tuples(st.just("reacquire"), st.integers(0, 50)),
        st.tuples(st.just("release_twice"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_the_region_always_shows_exactly_the_held_timers(
        region: tuple[TimerServer, mmap.mmap], ops: list[tuple]) -> None:
    srv, view = region
    timer.detach()
    timer.attach(srv.path, 0)
    held: dict[int, tuple[timer.Timer, int, int, str]] = {}  # id -> (timer, lo, hi, scope)
    idle: list[tuple[timer.Timer, str, float]] = []
    try:
        for op in ops:
            if op[0] == "acquire":
                _, after, scope = op
                lo = time.monotonic_ns() + int(after * 1e9)
                t = timer.acquire(after, scope)
                hi = time.monotonic_ns() + int(after * 1e9) + 2 * (1 << L.SCOPE_BITS)
                held[id(t)] = (t, lo, hi, scope)
            elif op[0] in ("release", "release_twice") and held:
                t, _, _, scope = list(held.values())[op[1] % len(held)]
                timer.release(t)  # any order, not only innermost first
                del held[id(t)]
                idle.append((t, scope, t.after))
                if op[0] == "release_twice":
                    with pytest.raises(TimerError):
                        timer.release(t)
            elif op[0] == "reacquire" and idle:
                t, scope, after = idle.pop(op[1] % len(idle))
                lo = time.monotonic_ns() + int(after * 1e9)
                t.acquire()
                hi = time.monotonic_ns() + int(after * 1e9) + 2 * (1 << L.SCOPE_BITS)
                held[id(t)] = (t, lo, hi, scope)
            words = armed(view)
            assert len(words) == len(held)
            names = scope_names(view)
            # Every held timer has its own word, naming its scope, whose deadline falls in the
            # window of its acquire (and no other word exists).
            pool = [(names[L.decode(w)[1]], L.decode(w)[0]) for w in words.values()]
            # Windows of timers acquired back to back overlap, so match as intervals to points:
            # earliest-closing window first, each taking the earliest deadline it can.
            pool.sort(key=lambda p: p[1])
            for _, lo, hi, scope in sorted(held.values(), key=lambda h: h[2]):
                match = next(p for p in pool if p[0] == scope and lo <= p[1] <= hi)
                pool.remove(match)
            assert pool == []
            for t, *_ in held.values():
                with pytest.raises(TimerError, match="already running"):
                    t.__enter__()
    finally:
        for t, *_ in list(held.values()):
            timer.release(t)
        assert armed(view) == {}
        assert L.U64.unpack_from(view, L.OFF_OWNER)[0] == os.getpid()
        timer.detach()


# -- faulthandler dumps ------------------------------------------------------------------------
USER = ["/home/u/train.py", "/home/u/model/layers.py", "<string>"]
LIB = ["/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py",
       "/venv/lib/python3.11/site-packages/elastictk/timer/client.py"]
FRAMES = st.builds(Frame, st.sampled_from(USER + LIB), st.integers(1, 99999),
                   st.sampled_from(["main", "all_reduce", "wait", "<module>", "run", "step"]))
THREADS = st.lists(
    st.builds(ThreadStack, st.integers(1, (1 << 64) - 1), st.booleans(),
              st.lists(FRAMES, max_size=8).map(tuple)),
    max_size=5, unique_by=lambda t: t.ident)


def render(threads: list[ThreadStack]) -> str:
    out = []
    for t in threads:
        head = "Current thread" if t.current else "Thread"
        out.append(f"{head} 0x{t.ident:016x} (most recent call first):")
        out += [f'  File "{f.filename}", line {f.lineno} in {f.name}' for f in t.frames]
        out.append("")
    return "\n".join(out)


@given(THREADS)
def test_a_dump_parses_back_to_its_threads(threads: list[ThreadStack]) -> None:
    assert parse(render(threads)) == threads
    assert parse("garbage\n" + render(threads)[: len(render(threads)) // 2]) is not None


@given(THREADS, st.sampled_from(["all_reduce", "wait(allreduce)", "custom"]), st.integers(0, 3))
def test_the_culprit_is_the_innermost_user_frame_of_the_stuck_thread(
        threads: list[ThreadStack], scope: str, main_index: int) -> None:
    main = threads[main_index].ident if main_index < len(threads) else 0
    thread, frame = culprit(threads, scope, main)
    with_frames = [t for t in threads if t.frames]
    if not with_frames:
        assert (thread, frame) == (None, None)
        return
    assert thread is not None and frame is not None and frame in thread.frames
    base = scope.split("(")[0]
    named = [t for t in with_frames if any(f.name in (scope, base) for f in t.frames)]
    if named:
        assert thread == named[0]
    elif any(t.ident == main for t in with_frames):
        assert thread.ident == main
    users = [f for f in thread.frames if f.filename in USER]
    assert frame == (users[0] if users else thread.frames[0])


@given(st.builds(
    Expiry, local_rank=st.integers(0, 7), rank=st.integers(0, 1000), pid=st.integers(2, 1 << 22),
    scope=st.text(max_size=20), deadline=st.floats(0, 1e6), detected_at=st.floats(0, 1e6),
    wall_time=st.floats(0, 2e9), where=st.one_of(st.none(), st.text(max_size=20)),
    stacks=st.text(max_size=100), stacks_note=st.text(max_size=20),
    held=st.lists(st.tuples(st.text(max_size=10), st.floats(-1e3, 1e3)), max_size=3).map(tuple),
))
def test_an_expiry_survives_json(e: Expiry) -> None:
    assert Expiry.from_json(e.to_json()) == e
    assert e.late_s >= 0 and e.headline().startswith(f"rank {e.rank} stuck in ")
    assert e.render().startswith(e.headline())


@given(st.lists(st.sampled_from(["/a", "/b c", SITE_DIR, ""]), max_size=5))
def test_worker_env_puts_the_site_hook_first_exactly_once(paths: list[str]) -> None:
    base = {"PYTHONPATH": os.pathsep.join(paths)} if paths else {}
    env = worker_env("/proc/1/fd/3", collective_timeout=5, base_env=base)
    got = env["PYTHONPATH"].split(os.pathsep)
    assert got[0] == SITE_DIR and got.count(SITE_DIR) == 1
    assert got[1:] == [p for p in paths if p and p != SITE_DIR]
    assert float(env[L.ENV_COLLECTIVE_TIMEOUT]) == 5.0
    assert worker_env("/x") == {L.ENV_REGIONS: "/x"}  # no collective timeout: no PYTHONPATH


@pytest.mark.parametrize("path, library", [
    ("/venv/site-packages/elastictk/metrics/blocked.py", True),   # the progress marks' wrapper
    ("/venv/site-packages/elastictk/timer/collectives.py", True),
    ("/venv/site-packages/torch/distributed/distributed_c10d.py", True),
    ("/work/job/train.py", False),
])
def test_elastictks_collective_wrappers_are_never_where_a_rank_is_stuck(path: str, library: bool) -> None:
    """The innermost frame that is not a library's names where a stuck rank stands: the wrappers
    elastictk puts around every collective (timers, progress marks) are skipped to the user's
    line (with the marks' wrapper counted as the user's, a frozen peer was named at
    metrics/worker.py, where the wrapper lived then, instead of train.py)."""
    assert Frame(path, 10, "f").is_library is library

"""The in-place store is covered by the job's token (issue #17).

With ``--rdzv-token`` the agent derives a per-run in-place key from the token and the run's
nonce and hands only that key to its workers (``ELASTICTK_INPLACE_KEY``); generation, ready
and error records on the in-place store are sealed with it, and one that does not verify reads
as absent, on the agent's side and on the workers'. Without a token nothing changes (the same
forged writes are believed: the failing side of each test).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastictk.agent.coordination import Budget
from elastictk.agent.inplace import InPlaceRound
from elastictk.agent.inplace_host import Setup, inplace_key
from elastictk.agent.policy import RestartPolicy
from elastictk.inplace.protocol import (
    ENV_KEY, Generation, Sealer, error_key, gen_key, newest, publish, ready_key, ready_value, round_prefix,
)
from elastictk.rendezvous.auth import Signer
from elastictk.rendezvous.sealed import Records, derive_key
from elastictk.store import FileStore, TCPStore
from elastictk.supervisor.group import WorkerGroup
from elastictk.supervisor.spec import WorkerSpec
from tests.test_inplace_scaling import CONF, INPLACE, ROOT, check_samples, close_to, fault_free, final_weights
from tests.test_worker_group import assignment

TOKEN = "s3cret-token"
RUN = "0123456789abcdef0123456789abcdef"
PREFIX = "round1"


def signer(run: str = RUN) -> Signer:
    return Signer(TOKEN, "sealed", run)


def test_the_inplace_key_is_derived_per_run_and_is_not_the_token() -> None:
    key = inplace_key(signer())
    assert key is not None and TOKEN not in key and len(key) == 64
    assert key == derive_key(signer(), "inplace")
    assert key != inplace_key(signer("f" * 32)), "another run, another key"
    assert key != derive_key(signer(), "other")
    assert inplace_key(Signer(None)) is None


def test_a_sealed_value_binds_its_key_name_and_value() -> None:
    key = inplace_key(signer())
    sealer = Sealer(key, PREFIX)
    raw = sealer.seal(error_key(0), b'{"rank":1}')
    assert sealer.open(error_key(0), raw) == b'{"rank":1}'
    assert sealer.open(error_key(1), raw) is None, "replayed under another generation"
    assert Sealer(key, "round2").open(error_key(0), raw) is None, "replayed under another round"
    assert sealer.open(error_key(0), raw[:-1] + b"}}") is None, "value changed"
    assert sealer.open(error_key(0), b'{"rank":1}') is None, "unsealed"
    assert sealer.open(error_key(0), b"") is None and sealer.open(error_key(0), None) is None
    assert Sealer(inplace_key(signer("f" * 32)), PREFIX).open(error_key(0), raw) is None
    plain = Sealer(None, PREFIX)  # no token: nothing sealed, all believed
    assert plain.seal(error_key(0), b"x") == b"x" and plain.open(error_key(0), b"x") == b"x"


def test_a_claim_replaces_forged_bytes_but_not_a_sealed_record() -> None:
    server = TCPStore.serve("127.0.0.1", 0)
    try:
        sealer = Sealer(inplace_key(signer()), PREFIX)
        name = f"{PREFIX}/{gen_key(1)}"

        def cas(old: Optional[bytes], new: bytes) -> Optional[bytes]:
            return server.compare_set(name, old, new)

        server.set(name, Generation(1, 2, finished=True).to_json())  # forged
        real = Generation(1, 2, reason="real").to_json()
        assert sealer.claim(gen_key(1), real, cas) == (True, real)
        assert sealer.open(gen_key(1), server.try_get(name)) == real
        assert sealer.claim(gen_key(1), b"later", cas) == (False, real)
    finally:
        server.close()


# -- the workers' side -----------------------------------------------------------------------

@contextlib.contextmanager
def worker_session(key: Optional[str]) -> Iterator[tuple[Any, TCPStore]]:
    import torch.distributed as dist

    from elastictk.inplace.session import Session

    server = TCPStore.serve("127.0.0.1", 0)
    raw = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                        timeout=datetime.timedelta(seconds=10), use_libuv=True)
    store = dist.PrefixStore(PREFIX, raw)
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", raw), rank=0, world_size=1)
        session = Session("gloo", 10, 0, 1, store, node="a", key=key, prefix=PREFIX)
        session.wait_s = 1.0
        yield session, server
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        del store, raw
        server.close()


def test_the_workers_ignore_a_forged_generation_and_follow_a_sealed_one() -> None:
    from elastictk.inplace.loop import Context, RecoveryError

    key = inplace_key(signer())
    sealer = Sealer(key, PREFIX)
    with worker_session(key) as (session, server):
        forged = Generation(1, 1, finished=True).to_json()
        server.set(f"{PREFIX}/{gen_key(1)}", forged)
        session._next_check = 0.0
        assert not session.superseded(0), "a forged next generation is absent"
        with pytest.raises(RecoveryError):
            session._next_generation(after=0)  # waited past, as if absent
        # Rank 0 ending the job replaces the forged record with its own sealed one.
        assert session.finish(Context(0, 1, generation=0)) is True
        ended = Generation.from_json(sealer.open(gen_key(1), server.try_get(f"{PREFIX}/{gen_key(1)}")) or b"")
        assert ended.finished and ended.reason == "finished"
        # A sealed generation is followed.
        server.set(f"{PREFIX}/{gen_key(2)}", sealer.seal(gen_key(2), Generation(2, 1, reason="real").to_json()))
        session._next_check = 0.0
        assert session.superseded(1)
        assert session._next_generation(after=1).reason == "real"
        # What the workers write is sealed: an error the agent can verify.
        session.report_error(Context(0, 1, generation=3), "peer gone")
        assert sealer.open(error_key(3), server.try_get(f"{PREFIX}/{error_key(3)}")) is not None


def test_without_a_token_the_workers_follow_a_forged_generation() -> None:
    """The failing side: the same forged record ends the workers' job."""
    from elastictk.inplace.loop import Context

    with worker_session(None) as (session, server):
        server.set(f"{PREFIX}/{gen_key(1)}", Generation(1, 1, finished=True).to_json())
        session._next_check = 0.0
        assert session.superseded(0)
        assert session._next_generation(after=0).finished
        assert session.finish(Context(0, 1, generation=0)) is False  # the "job" is someone else's now


# -- the agent's side ------------------------------------------------------------------------

@contextlib.contextmanager
def agent_round(tmp_path: Path, token: bool) -> Iterator[tuple[InPlaceRound, TCPStore, list[Any]]]:
    events: list[Any] = []
    server = TCPStore.serve("127.0.0.1", 0)
    files = FileStore(tmp_path / "job")
    job = Budget(Records(files, "rdzv/sealed", signer() if token else Signer(None)))
    spec = WorkerSpec(["/bin/sh", "-c", "exec sleep 600"], local_world_size=2)
    setup = Setup(f"127.0.0.1:{server.port}", PREFIX, 0, False)
    try:
        with WorkerGroup(spec, tmp_path / "logs") as group:
            group.start(0, assignment(group_rank=0, nodes=1))
            rnd = InPlaceRound(group, job, RestartPolicy(max_restarts=0), setup, 2, {"n0": 0},
                               emit=lambda kind, **kw: events.append((kind, kw)))
            try:
                yield rnd, server, events
            finally:
                rnd.close()
                group.stop(grace=5)
    finally:
        files.close()
        server.close()


def forged_error() -> bytes:
    return json.dumps({"rank": 1, "error": "forged", "t": time.time()}).encode()


def saw_error(rnd: InPlaceRound, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if rnd._errors.is_set():
            return True
        time.sleep(0.05)
    return False


def test_the_agent_ignores_a_forged_error_and_ready_and_acts_on_sealed_ones(tmp_path: Path) -> None:
    with agent_round(tmp_path, token=True) as (rnd, server, events):
        key = rnd.env("n0", 0)[ENV_KEY]
        assert key == inplace_key(signer()) and TOKEN not in json.dumps(rnd.env("n0", 0))
        sealer = Sealer(key, PREFIX)
        server.set(f"{PREFIX}/{error_key(0)}", forged_error())
        server.set(f"{PREFIX}/{ready_key(0)}", ready_value(time.time()))
        assert not saw_error(rnd, 1.5), "a forged error is absent"
        assert not rnd.poll() and rnd.deadline is None
        assert not rnd.cooperative() and not rnd._formed(0)
        server.set(f"{PREFIX}/{ready_key(0)}", sealer.seal(ready_key(0), ready_value(time.time())))
        assert rnd.cooperative()
        server.set(f"{PREFIX}/{error_key(0)}", sealer.seal(error_key(0), forged_error()))
        assert saw_error(rnd, 5), "a sealed error wakes the agent"
        assert not rnd.poll() and rnd.deadline is not None
        assert not events


def test_the_agent_publishes_sealed_generations_over_forged_bytes(tmp_path: Path) -> None:
    with agent_round(tmp_path, token=True) as (rnd, server, _events):
        sealer = Sealer(rnd.env("n0", 0)[ENV_KEY], PREFIX)
        server.set(f"{PREFIX}/{gen_key(1)}", Generation(1, 2, finished=True).to_json())  # forged, first
        assert rnd._next(3, "replaced") == 1
        g = Generation.from_json(sealer.open(gen_key(1), server.try_get(f"{PREFIX}/{gen_key(1)}")) or b"")
        assert (g.gen, g.restart_count, g.reason, g.finished) == (1, 3, "replaced", False)


def test_without_a_token_the_agent_acts_on_a_forged_error(tmp_path: Path) -> None:
    """The failing side: the same forged error wakes the agent, which starts the countdown to
    restarting every worker."""
    with agent_round(tmp_path, token=False) as (rnd, server, _events):
        assert ENV_KEY not in rnd.env("n0", 0)
        server.set(f"{PREFIX}/{error_key(0)}", forged_error())
        assert saw_error(rnd, 5)
        assert not rnd.poll() and rnd.deadline is not None


@given(st.integers(0, 3000), st.integers(0, 3000), st.sets(st.integers(0, 6000), max_size=20))
def test_the_newest_record_is_found_by_reading_records(end: int, known: int, beyond: set[int]) -> None:
    """Records 0..end are there (published without gaps); ``beyond`` are numbers past the end a
    stranger wrote bytes at, which do not verify (a sealed record binds its number, so not even
    a replayed one does): the search from any known record stops at ``end``, in O(log n)
    reads. (A verifying record past a gap cannot exist in a token job; no O(log n) search could
    see past one without reading every number.)"""
    known = min(known, end)
    reads = []
    written = set(range(end + 1)) | beyond

    def present(g: int) -> bool:
        reads.append(g)
        return g in written and g <= end  # written, and verifies

    assert newest(present, known) == end
    assert len(reads) <= 2 * (end - known + 1).bit_length() + 1


@given(st.lists(st.sampled_from(["agent", "finished", "forged", "garbage"]), max_size=6))
def test_publish_takes_the_first_number_free_of_a_sealed_record(before: list[str]) -> None:
    """Whatever is there after generation 0: other agents' records are skipped, forged or
    garbage bytes are replaced (never believed), and the workers' ``finished`` record ends the
    search (that number is returned, the job ended)."""
    sealer = Sealer(inplace_key(signer()), PREFIX)
    kv: dict[str, bytes] = {gen_key(0): sealer.seal(gen_key(0), Generation(0, 2).to_json())}
    for i, what in enumerate(before, start=1):
        rec = Generation(i, 2, finished=what == "finished").to_json()
        kv[gen_key(i)] = {"agent": sealer.seal(gen_key(i), rec), "finished": sealer.seal(gen_key(i), rec),
                          "forged": rec, "garbage": b"\xff not json"}[what]

    def cas(key: str, old: Optional[bytes], new: bytes) -> Optional[bytes]:
        if kv.get(key) == (old or None) or (old == b"" and key not in kv):
            kv[key] = new
        return kv.get(key)

    sealed_before = {k: v for k, v in kv.items() if sealer.open(k, v) is not None}
    g = publish(sealer, kv.get, cas, 0, lambda n: Generation(n, 2, 5, "replaced"))
    assert g >= 1
    assert {k: kv[k] for k in sealed_before} == sealed_before, "no sealed record is overwritten"
    rec = Generation.from_json(sealer.open(gen_key(g), kv[gen_key(g)]) or b"")
    if gen_key(g) in sealed_before:
        assert rec.finished, "only the workers' finished record stops a publisher on a taken number"
    else:
        assert (rec.gen, rec.restart_count, rec.finished) == (g, 5, False)
    if all(w == "agent" for w in before):
        assert g == len(before) + 1, "honest records: the number after the newest"


@pytest.mark.parametrize("forged", [b"not a number", Generation(1, 2, finished=True).to_json()])
def test_a_strangers_next_generation_moves_no_agent_and_stops_no_watch(tmp_path: Path, forged: bytes) -> None:
    """Bytes a stranger writes as the next generation's record (garbage, or a well-formed
    unsealed record) are not followed and leave the watch running; a sealed error afterwards
    still wakes the agent, and the agent's next generation replaces the forged bytes."""
    with agent_round(tmp_path, token=True) as (rnd, server, events):
        server.set(f"{PREFIX}/gen", b"not a number")  # where a counter would be: read by nobody
        server.set(f"{PREFIX}/{gen_key(1)}", forged)
        server.set(f"{PREFIX}/{gen_key(7)}", Generation(7, 2, finished=True).to_json())
        time.sleep(1.0)  # the watch looks every 0.1 s
        assert rnd.gen == 0 and rnd.pending is None and rnd.deadline is None
        assert rnd._watcher.is_alive(), "the in-place watch is still running"
        sealer = Sealer(rnd.env("n0", 0)[ENV_KEY], PREFIX)
        server.set(f"{PREFIX}/{error_key(0)}", sealer.seal(error_key(0), forged_error()))
        assert saw_error(rnd, 5), "a sealed error still wakes the agent"
        assert rnd._next(1, "replaced") == 1
        assert sealer.open(gen_key(1), server.try_get(f"{PREFIX}/{gen_key(1)}")) is not None
        assert not events


def test_without_a_token_a_next_generation_record_is_followed(tmp_path: Path) -> None:
    """The failing side: without a token, a generation record is believed as written."""
    with agent_round(tmp_path, token=False) as (rnd, server, _events):
        server.set(f"{PREFIX}/{gen_key(1)}", Generation(1, 2).to_json())
        deadline = time.monotonic() + 5
        while rnd.gen != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rnd.gen == 1 and rnd.pending == 1


# -- end to end ------------------------------------------------------------------------------

STEPS = 40


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (the agent: its in-place store)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def events_of(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# No node is lost here, so nothing waits on the heartbeat timeout: 30 s, not CONF's 3 s. A node
# whose own beat has not reached the store for the timeout stops its workers (its peers would
# count it lost) and this job ends with exit 1; beside busy processes a Python thread here woke
# up to 6 s late (load average 30 on 2 cores), and with 3 s one job in six ended that way.
ATTACKED_CONF = CONF.replace("heartbeat_timeout=3", "heartbeat_timeout=30")


def run_attacked(tmp: Path, token: bool) -> tuple[int, str, list[dict[str, Any]], list[dict[str, Any]]]:
    """One node, two workers, in place; at step 5 a stranger writes a forged error for the
    current generation and a forged "finished" next generation into the in-place store."""
    trace, events = tmp / "trace.jsonl", tmp / "events.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "ELASTICTK_RDZV_TOKEN"}
    if token:
        env["ELASTICTK_RDZV_TOKEN"] = TOKEN
    cmd = [sys.executable, "-m", "elastictk.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "file", "--rdzv-endpoint", str(tmp / "rdzv"), "--rdzv-id", "sealed",
           "--rdzv-conf", ATTACKED_CONF, "--max-restarts", "0", "--recovery", "in-place",
           "--log-dir", str(tmp / "logs"), "--event-log", str(events),
           INPLACE, "--steps", str(STEPS), "--step-time", "0.1", "--trace", str(trace)]
    agent = subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env={**env, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 300  # far past a loaded host's start of an in-place job
        while not any(t.get("step", -1) >= 5 for t in events_of(trace)):
            if agent.poll() is not None:  # say why (under load it was the fence, see ATTACKED_CONF)
                raise AssertionError(f"the job ended before step 5: {agent.communicate()[0][-3000:]}")
            assert time.monotonic() < deadline, "the job never reached step 5"
            time.sleep(0.1)
        kinds = events_of(events)
        rnd = [e for e in kinds if e["kind"] == "round_joined"][-1]["fields"]["round"]
        attempt = [e for e in kinds if e["kind"] == "workers_started"][-1]["fields"]["attempt"]
        prefix = round_prefix("sealed", rnd, attempt)
        (port,) = listening_ports(agent.pid)
        stranger = TCPStore.connect(f"127.0.0.1:{port}")
        try:
            stranger.set(f"{prefix}/{error_key(0)}", forged_error())
            stranger.set(f"{prefix}/{gen_key(1)}", Generation(1, 2, finished=True).to_json())
        finally:
            stranger.close()
        out = agent.communicate(timeout=180)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
    return agent.returncode, out, events_of(events), events_of(trace)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return fault_free(tmp_path_factory.mktemp("ref"), STEPS)


def test_a_forged_error_and_generation_do_not_disturb_a_job_with_a_token(
        tmp_path: Path, reference: list[float]) -> None:
    rc, out, kinds, trace = run_attacked(tmp_path, token=True)
    assert rc == 0, out[-3000:]
    names = [e["kind"] for e in kinds]
    for bad in ("worker_failed", "worker_frozen", "inplace_fallback", "restart", "inplace_recovery"):
        assert bad not in names, (bad, out[-3000:])
    assert names.count("workers_started") == 1
    assert [e for e in kinds if e["kind"] == "job_finished"][-1]["fields"]["restarts"] == 0
    assert "ignored in-place store key" in out, out[-3000:]
    assert set(check_samples(trace, STEPS).values()) == {2}
    assert {t["gen"] for t in trace if "step" in t} == {0}, "the workers never left generation 0"
    assert close_to(final_weights(trace), reference)


def test_without_a_token_the_same_forged_writes_end_the_job_early(tmp_path: Path) -> None:
    """The failing side: the workers believe the forged "finished" generation and stop."""
    _rc, out, _kinds, trace = run_attacked(tmp_path, token=False)
    trained = {t["step"] for t in trace if "step" in t}
    assert max(trained) < STEPS - 1, out[-3000:]
    with pytest.raises(AssertionError):
        check_samples(trace, STEPS)


@pytest.mark.parametrize("formed", [True, False])
def test_a_generation_formed_just_before_the_workers_finished_is_reported(tmp_path: Path, formed: bool) -> None:
    """Workers can re-form and finish a short job within the watcher's re-arm; when every worker
    has finished, the agent still reports the recovery (``settle``) if, and only if, the
    generation's ready record is there."""
    from elastictk.metrics.kinds import EventKind

    with agent_round(tmp_path, token=False) as (rnd, server, events):
        rnd._stop.set()  # the watcher is asleep at the wrong moment, for good
        rnd._watcher.join(timeout=5)
        rnd.pending, rnd.gen = 1, 1
        rnd._begin_deadline()
        if formed:
            server.set(f"{PREFIX}/{ready_key(1)}", ready_value(time.time()))
        assert not rnd.poll() and not events, "nothing the watcher saw"
        rnd.settle()
        got = [(k, kw["generation"]) for k, kw in events]
        assert got == ([(EventKind.INPLACE_RECOVERED, 1)] if formed else [])
        assert (rnd.pending is None) == formed


def test_a_formed_generation_is_reported_before_the_watch_moves_to_a_newer_record(tmp_path: Path) -> None:
    """The workers re-form generation 1 and, a few steps later, publish their ``finished``
    record as generation 2, all between two looks of the watcher: generation 1's recovery is
    still reported (it formed), and only then does the watch move on."""
    from elastictk.metrics.kinds import EventKind

    with agent_round(tmp_path, token=False) as (rnd, server, events):
        server.set(f"{PREFIX}/{gen_key(1)}", Generation(1, 2, 1, "replaced").to_json())
        server.set(f"{PREFIX}/{ready_key(1)}", ready_value(time.time()))
        server.set(f"{PREFIX}/{gen_key(2)}", Generation(2, 2, 1, finished=True).to_json())
        with rnd._lock:
            rnd.pending, rnd.gen = 1, 1
            rnd._begin_deadline()
        deadline = time.monotonic() + 5
        while not rnd._ready.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # the watcher looks again (every 0.1 s): it must not drop generation 1
        assert rnd.pending == 1 and rnd._ready.is_set()
        assert not rnd.poll()
        assert [(k, kw["generation"]) for k, kw in events] == [(EventKind.INPLACE_RECOVERED, 1)]
        deadline = time.monotonic() + 5
        while rnd.gen != 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rnd.gen == 2, "then the watch follows the newer record"

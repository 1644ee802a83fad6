"""The disk tier against someone else's files: planted steps, planted symlinks, shared directories.

A planted step is made by another user (``setpriv`` to uid 65534) where the tests run as root,
as another local user would make it in a shared checkpoint directory; its ``.metadata`` is a
pickle that creates a marker file when unpickled. Nothing of it may run, and the job restores
the older step it wrote itself. Symlinks planted at the next step's path and at the names DCP
writes must not be followed (their targets stay as they were).
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastictk.snapshot import trust
from elastictk.snapshot.dcp import COMPLETE, DcpDisk, step_dir

from .test_snapshot_dcp import run
from .test_snapshot_units import _tree

SETPRIV = shutil.which("setpriv")
needs_other_user = pytest.mark.skipif(
    os.geteuid() != 0 or SETPRIV is None,
    reason="planting as another user needs root and setpriv (to become uid 65534)")


def as_nobody(script: str) -> None:
    """Run shell ``script`` as uid/gid 65534, with no groups: another local user."""
    assert SETPRIV is not None
    subprocess.run([SETPRIV, "--reuid", "65534", "--regid", "65534", "--clear-groups",
                    "sh", "-ec", script], check=True, timeout=30)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory under /tmp that uid 65534 can reach (the test's tmp_path is mode 0700)."""
    d = Path(tempfile.mkdtemp(prefix="etk-shared-", dir="/tmp"))
    os.chmod(d, 0o711)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


class Evil:
    """Unpickling this runs code: it writes the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def forge(src: Path, dst: Path, step: int, marker: Path) -> None:
    """A copy of step directory ``src`` as step ``step`` whose ``.metadata`` runs code, with a
    ``COMPLETE`` that lists the right checksums of every file (what anyone can compute)."""
    shutil.copytree(src, dst)
    (dst / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    files = {p.name: f"{xxhash.xxh3_64_intdigest(p.read_bytes()):016x}"
             for p in dst.iterdir() if p.name != COMPLETE}
    old = (src / COMPLETE).read_bytes()
    body = {"step": step, "world_size": 2, "files": files}
    if old.startswith(b"{"):  # the marker's JSON alone (before sealing existed)
        (dst / COMPLETE).write_bytes(json.dumps(body, sort_keys=True).encode())
    else:
        body["sha256"] = {n: hashlib.sha256((dst / n).read_bytes()).hexdigest()
                          for n in (".metadata", "skeleton.pt")}
        (dst / COMPLETE).write_bytes(trust.seal(None, dst.name, json.dumps(body).encode()))
    for p in [dst, *dst.iterdir()]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)


@needs_other_user
def test_a_step_planted_by_another_user_never_runs_its_pickle(tmp_path: Path, shared: Path) -> None:
    snaps, marker = shared / "snaps", shared / "ran"
    _, _, saved = run(tmp_path, "first", 2, snaps)
    forge(step_dir(snaps, 6), shared / "stage", 9, marker)
    os.chmod(shared / "stage", 0o755)
    mode = stat.S_IMODE(os.stat(snaps).st_mode)
    os.chmod(snaps, 0o777)  # a while when the directory was shared: the other user plants step 9
    as_nobody(f"cp -r {shared / 'stage'} {step_dir(snaps, 9)}")
    os.chmod(snaps, mode)
    assert os.stat(step_dir(snaps, 9)).st_uid == 65534
    out, recs, back = run(tmp_path, "again", 2, snaps, "--seed", "7")
    assert not marker.exists(), "the planted .metadata was unpickled"
    assert {r["restored"] for r in recs} == {6}, out[-3000:]
    lines = [x for x in out.splitlines() if "refused" in x]
    assert len(lines) == 1, out[-3000:]
    assert f"snapshot step 9 in {snaps} refused: {step_dir(snaps, 9)} is owned by user id 65534" in lines[0]


def test_a_step_not_sealed_with_the_jobs_key_is_refused_before_any_file_is_parsed(tmp_path: Path) -> None:
    """With a key (the job's token), a step of ours whose seal is another key's or missing is
    refused: its .metadata is never unpickled, the older sealed step is used."""
    marker = tmp_path / "ran"
    root = tmp_path / "snaps"
    d = DcpDisk(str(root), 0, 1, key="k-this-job")
    assert d.save(3, _tree(3), None) and d.save(6, _tree(6), None)
    for step, key in ((9, "k-another-job"), (12, None)):
        forge(step_dir(root, 6), step_dir(root, step), step, marker)
        complete = step_dir(root, step) / COMPLETE
        body = complete.read_bytes().partition(b"\n")[2].replace(b'"world_size": 2', b'"world_size": 1')
        complete.write_bytes(trust.seal(key, step_dir(root, step).name, body))
        for p in [step_dir(root, step), *step_dir(root, step).iterdir()]:
            os.chmod(p, 0o700 if p.is_dir() else 0o600)
    assert DcpDisk(str(root), 0, 1, key="k-another-job").complete_steps() == [9]  # it is sealed
    assert d.complete_steps() == [6, 3]
    assert "does not verify with this job's key" in d.refused[9]
    assert "is not sealed" in d.refused[12]
    assert "does not verify" in (d.verify(9) or "")
    with pytest.raises(trust.Refused):
        d.load(9, None)
    assert not marker.exists()
    assert d.load(6, None)["values"] == _tree(6)["values"]


@needs_other_user
def test_symlinks_planted_at_the_next_step_and_at_dcps_names_are_not_followed(shared: Path) -> None:
    root = shared / "snaps"
    d = DcpDisk(str(root), 0, 1)
    assert d.save(3, _tree(3), None)
    victims = {n: shared / f"victim-{n}" for n in ("step", "metadata", "part", "skeleton")}
    for v in victims.values():
        v.write_text("precious")
        os.chmod(v, 0o600)
    (shared / "evil").mkdir()
    os.chmod(shared / "evil", 0o777)  # a directory the other user may write (theirs, in effect)
    os.chmod(root, 0o777)
    as_nobody(f"""
        ln -s {victims['part']} {shared}/evil/__0_0.distcp
        ln -s {shared}/evil {step_dir(root, 6)}
        mkdir -m 777 {step_dir(root, 9)}
        ln -s {victims['metadata']} {step_dir(root, 9)}/.metadata.tmp
        ln -s {victims['metadata']} {step_dir(root, 9)}/.metadata
        ln -s {victims['part']} {step_dir(root, 9)}/__0_0.distcp
        ln -s {victims['skeleton']} {step_dir(root, 9)}/skeleton.pt
        ln -s {victims['step']} {step_dir(root, 12)}
    """)
    os.chmod(root, 0o700)
    for step in (6, 9, 12):
        with pytest.raises(trust.Refused, match="is not this job's to replace"):
            d.save(step, _tree(step), None)
    assert {n: v.read_text() for n, v in victims.items()} == dict.fromkeys(victims, "precious")
    assert sorted(p.name for p in (shared / "evil").iterdir()) == ["__0_0.distcp"]
    assert d.complete_steps() == [3]
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # the temp dirs are gone


def test_files_swapped_under_a_verified_step_are_never_parsed(tmp_path: Path) -> None:
    """A keyed step verifies; then its .metadata and skeleton.pt are swapped for a pickle that
    writes a marker (the seal still holds: it covers COMPLETE, whose SHA-256s load() checks):
    load() refuses on the SHA-256 and the pickle never runs."""
    marker = tmp_path / "ran"
    root = tmp_path / "snaps"
    d = DcpDisk(str(root), 0, 1, key="k-this-job")
    assert d.save(3, _tree(3), None)
    assert d.verify(3) is None and d.complete_steps() == [3]
    for name in (".metadata", "skeleton.pt"):
        (step_dir(root, 3) / name).write_bytes(pickle.dumps(Evil(marker)))
    assert d.complete_steps() == [3]  # the seal still verifies: only the SHA-256s tell
    with pytest.raises(trust.Refused, match="SHA-256 .* is not the one in COMPLETE"):
        d.load(3, None)
    assert not marker.exists(), "a swapped file was unpickled"


def test_a_step_directory_others_can_write_is_refused_in_a_private_root(tmp_path: Path) -> None:
    """Without root: our own step directory made 0777 (anyone could swap its files) is refused,
    the root itself private; the step before it is used."""
    root = tmp_path / "snaps"
    d = DcpDisk(str(root), 0, 1)
    assert d.save(3, _tree(3), None) and d.save(6, _tree(6), None)
    os.chmod(step_dir(root, 6), 0o777)
    assert d.complete_steps() == [3]
    assert "is writable by group or others (mode 0777)" in d.refused[6]
    with pytest.raises(trust.Refused, match="writable by group or others"):
        d.load(6, None)
    assert d.load(3, None)["values"] == _tree(3)["values"]


def test_steps_are_private_and_a_redone_step_replaces_our_own(tmp_path: Path) -> None:
    root = tmp_path / "snaps"
    d = DcpDisk(str(root), 0, 1)
    for step in (3, 6, 6):  # 6 again: a step redone after a restore from 3
        assert d.save(step, _tree(step + 1 if step == 6 else step), None)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    for s in (3, 6):
        assert stat.S_IMODE(os.stat(step_dir(root, s)).st_mode) == 0o700
        modes = {p.name: stat.S_IMODE(os.lstat(p).st_mode) for p in step_dir(root, s).iterdir()}
        assert set(modes.values()) == {0o600}, modes
        assert set(modes) == {"COMPLETE", ".metadata", "skeleton.pt", "__0_0.distcp"}
    assert d.complete_steps() == [6, 3]
    assert d.load(6, None)["values"] == _tree(7)["values"]
    assert sorted(p.name for p in root.iterdir()) == ["step-0000000003", "step-0000000006"]


@pytest.mark.parametrize("how", ["group-writable", "symlink", "another owner"])
def test_a_snapshot_directory_others_can_write_is_refused_whole(tmp_path: Path, how: str) -> None:
    real = tmp_path / "snaps"
    assert DcpDisk(str(real), 0, 1).save(3, _tree(3), None)
    root = real
    if how == "group-writable":
        os.chmod(real, 0o770)
    elif how == "symlink":
        root = tmp_path / "link"
        root.symlink_to(real)
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(real, 65534, 65534)
    d = DcpDisk(str(root), 0, 1)
    assert d.complete_steps() == []
    assert "-1" not in d.refused and d.refused[-1]
    assert trust.usable_root(str(root)) is not None
    with pytest.raises(trust.Refused):
        d.save(6, _tree(6), None)
    assert sorted(p.name for p in real.iterdir()) == ["step-0000000003"]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    (cwd / "s.py").write_text("print('ran')\n")
    return subprocess.run([sys.executable, "-m", "elastictk.run", "--standalone", *args, "s.py"],
                          cwd=cwd, capture_output=True, text=True, timeout=60)


def test_snapshot_flags_that_cannot_work_exit_2_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    shared_dir = tmp_path / "shared"
    shared_dir.mkdir(mode=0o777)
    os.chmod(shared_dir, 0o777)
    cases = [(("--snapshot-dir", str(tmp_path / "afile")), "is not a directory"),
             (("--snapshot-dir", str(tmp_path / "afile" / "sub")), "cannot be made under it"),
             (("--snapshot-dir", str(shared_dir)), "writable by group or others"),
             (("--snapshot", "local", "--snapshot-memory", "1e400"), "more than this host's memory"),
             (("--snapshot", "local", "--snapshot-memory", "1e30"), "more than this host's memory")]
    for args, want in cases:
        p = _cli(*args, cwd=tmp_path)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and want in lines[0], (args, p.stderr)
        assert "Traceback" not in p.stderr and "ran" not in p.stdout


# -- the COMPLETE reader against garbage ----------------------------------------------------------
_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=20)
_marker = st.fixed_dictionaries({}, optional={
    "step": st.one_of(st.just(3), st.integers(), st.floats(), st.text(max_size=3)),
    "world_size": st.one_of(st.just(1), st.integers(-2, 2), st.none()),
    "files": st.one_of(st.dictionaries(st.sampled_from(["__0_0.distcp", ".metadata", "skeleton.pt", "../x", "a/b"]),
                                       st.one_of(st.text(alphabet="0123456789abcdef", min_size=16, max_size=16),
                                                 st.integers(), _json)), _json),
    "sha256": st.one_of(st.dictionaries(st.sampled_from([".metadata", "skeleton.pt"]),
                                        st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)), _json)})


def _body(x: object) -> bytes:
    return json.dumps(x, allow_nan=True).encode()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    st.binary(max_size=300),
    st.builds(lambda b: b"unsealed\n" + b, st.binary(max_size=200)),
    st.builds(lambda m: b"unsealed\n" + _body(m), _marker),
    st.builds(lambda m: b"unsealed\n" + _body(m), _json),
    st.builds(lambda n: b"unsealed\n" + b"[" * n + b"]" * n, st.integers(1, 100_000)),
    st.builds(lambda b: b"unsealed\n" + b, st.sampled_from([b'{"step": NaN}', b'{"step": Infinity}',
                                                            b'\xff\xfe{"step": 3}', b'{"step": 3'])),
    st.builds(lambda m: trust.seal("k", "step-0000000003", _body(m)), _marker),
))
def test_the_complete_reader_refuses_garbage_in_one_clause(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.chmod(root, 0o700)
        step_dir(root, 3).mkdir(mode=0o700)
        (step_dir(root, 3) / COMPLETE).write_bytes(raw)
        for key in (None, "k", "other"):
            d = DcpDisk(str(root), 0, 1, key=key)
            try:
                m = d.check(3)
            except trust.Refused as e:
                assert "\n" not in str(e)
                assert isinstance(d.verify(3), str)
                continue
            assert m["step"] == 3 and isinstance(m["files"], dict)
            assert key != "other"  # nothing sealed with "other" is in the strategies
            assert raw.startswith(b"hmac-sha256 ") == (key is not None)


def test_a_huge_complete_is_refused_without_reading_it(tmp_path: Path) -> None:
    step_dir(tmp_path, 3).mkdir(mode=0o700)
    with open(step_dir(tmp_path, 3) / COMPLETE, "wb") as f:
        f.truncate(trust.MAX_MARKER + 1)  # sparse
    with pytest.raises(trust.Refused, match="more than"):
        DcpDisk(str(tmp_path), 0, 1).check(3)


def test_the_agent_hands_workers_a_key_derived_from_the_token_never_the_token(tmp_path: Path) -> None:
    from elastictk.agent.launch import snapshot_env
    from elastictk.cli.args import parse_args
    from elastictk.snapshot.settings import ENV_KEY

    def env(*flags: str) -> dict[str, str]:
        return snapshot_env(parse_args([*flags, "--snapshot-dir", str(tmp_path / "s"), "x.py"], {},
                                       check=False))

    job = ("--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1", "--nnodes", "1:2")
    a = env(*job, "--rdzv-id", "j1", "--rdzv-token", "secret-token")
    assert a[ENV_KEY] and "secret-token" not in "".join(a.values())
    assert env(*job, "--rdzv-id", "j1", "--rdzv-token", "secret-token")[ENV_KEY] == a[ENV_KEY]  # a relaunch
    assert env(*job, "--rdzv-id", "j2", "--rdzv-token", "secret-token")[ENV_KEY] != a[ENV_KEY]  # another job
    assert env(*job, "--rdzv-id", "j1", "--rdzv-token", "other-token")[ENV_KEY] != a[ENV_KEY]
    solo = env("--standalone", "--rdzv-token", "secret-token")[ENV_KEY]  # a new job id each launch
    assert solo == env("--standalone", "--rdzv-token", "secret-token")[ENV_KEY] != a[ENV_KEY]
    assert ENV_KEY not in env("--standalone")  # its own token is random per launch: no key

"""Paths elastictk writes where a user points it or where others can write (elastictk/_paths.py):
chaos ``--report-dir`` and what it writes, ``--event-log``, ``--log-dir``, plan files, the
workers' sitecustomize, and ``--replay``'s report.

The attacks are made by another user (``setpriv`` to uid 65534, as in test_store_file.py and
test_snapshot_trust.py) in a shared sticky directory like ``/tmp``, while the tests run as root,
which passes every permission check: only elastictk's own checks stand in the way.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastictk import _paths
from elastictk.chaos import cli as chaos_cli
from elastictk.chaos import runner
from elastictk.chaos.record import RunRecord
from elastictk.cli import UsageError
from elastictk.cli.preflight import check_event_log, check_log_dir
from elastictk.faults import Fault, plan_of
from elastictk.faults import env as fenv
from elastictk.faults import inworker
from elastictk.metrics.events import EventLog, EventLogError
from elastictk.supervisor.logs import LogDirError, claim_run_dir

ROOT = Path(__file__).resolve().parent.parent
SETPRIV = shutil.which("setpriv")
as_root = pytest.mark.skipif(
    os.geteuid() != 0 or SETPRIV is None,
    reason="planting as another user needs root and setpriv (to become uid 65534)")
SECRET = "root's own 0600 file\n"


def nobody(script: str, cwd: Path) -> None:
    """Run ``sh -c script`` as uid/gid 65534 (no groups) in ``cwd``."""
    subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                    "sh", "-c", script], cwd=cwd, check=True, timeout=30)


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A shared sticky directory, like /tmp (owned by this user, mode 1777)."""
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o1777)
    return d


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of this user's, mode 0600, that a planted symlink points at."""
    v = tmp_path / "victim"
    v.write_text(SECRET)
    v.chmod(0o600)
    return v


def one_line(text: str) -> str:
    lines = [x for x in text.splitlines() if x.strip()]
    assert len(lines) == 1, text
    return lines[0]


# -- the rule itself ----------------------------------------------------------------------------
@given(mine=st.booleans(), mode=st.integers(0, 0o7777))
def test_a_directory_passes_only_when_it_is_mine_and_nobody_else_can_write_it(mine: bool, mode: int) -> None:
    uid = os.geteuid() if mine else os.geteuid() + 1
    st_ = os.stat_result((stat.S_IFDIR | mode, 0, 0, 2, uid, 0, 0, 0, 0, 0))
    problem = _paths.owner_problem("/d", st_)
    assert (problem is None) == (mine and not mode & 0o022)
    if problem is not None:
        assert "\n" not in problem and "/d" in problem
        assert (f"owned by user id {uid}" in problem) if not mine else (f"mode {mode:04o}" in problem)
        if mine and mode & 0o1002 == 0o1002:  # /tmp: a private subdirectory, never chmod go-w /tmp
            assert "private subdirectory" in problem and "chmod" not in problem


def test_a_shared_sticky_directory_gets_one_fix_from_the_launcher_and_the_path_rule(tmp_path: Path) -> None:
    """/tmp (mode 1777) named where a private directory is needed: the launcher's first check
    (--snapshot-dir) and the owner rule (log, report, event-log directories) offer the same
    private subdirectory, worded in one place (_paths.private_subdir_fix)."""
    from elastictk.cli.preflight import shared_dir_first_fix

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    fix = _paths.private_subdir_fix(str(shared))
    assert "chmod" not in fix and fix.endswith("-elastictk (created mode 0700)")
    problem = _paths.owner_problem(str(shared), os.stat(shared))
    assert problem is not None and problem.endswith(f"use {fix}")
    with pytest.raises(UsageError) as e:
        shared_dir_first_fix(str(shared), "--snapshot-dir")
    assert str(e.value).endswith("give " + _paths.private_subdir_fix(str(shared), "--snapshot-dir"))
    assert fix.split("e.g. ")[1] == str(e.value).split("e.g. --snapshot-dir ")[1]
    shared.chmod(0o777)  # writable by all without the sticky bit: the general rule's fix
    shared_dir_first_fix(str(shared), "--snapshot-dir")
    assert "chmod go-w" in (_paths.owner_problem(str(shared), os.stat(shared)) or "")


KINDS = {"file": stat.S_IFREG, "fifo": stat.S_IFIFO, "chardev": stat.S_IFCHR, "blockdev": stat.S_IFBLK,
         "dir": stat.S_IFDIR, "symlink": stat.S_IFLNK, "socket": stat.S_IFSOCK}


@given(kind=st.sampled_from(sorted(KINDS)), owner=st.sampled_from(["me", "root", "other"]),
       mode=st.integers(0, 0o7777))
def test_what_an_append_may_open_is_a_file_or_fifo_of_mine_or_a_device(kind: str, owner: str, mode: int) -> None:
    """open_append's judgement of what it found (lstat before, fstat after the open)."""
    uid = {"me": os.geteuid(), "root": 0, "other": 65534 if os.geteuid() != 65534 else 65533}[owner]
    st_ = os.stat_result((KINDS[kind] | mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))
    mine = uid == os.geteuid()
    ok = kind == "chardev" or (kind in ("file", "fifo") and mine)
    try:
        _paths._check_appendable("/x/ev", st_)
    except _paths.Unsafe as e:
        assert not ok and "\n" not in str(e) and "/x/ev" in str(e)
    else:
        assert ok


def test_make_own_dir_makes_0700_whatever_the_umask_and_refuses_a_shared_one(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        made = _paths.make_own_dir(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700 == stat.S_IMODE(made.parent.stat().st_mode)
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(_paths.Unsafe, match=r"writable by group or others \(mode 0777\); run chmod go-w"):
        _paths.make_own_dir(tmp_path / "open")


# -- finding 1: elastictk-chaos --report-dir ----------------------------------------------------
@as_root
def test_a_report_dir_another_user_made_first_is_refused_and_nothing_planted_runs(
        shared: Path, victim: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The attack: nobody makes the report directory in /tmp first, plants a module the venv's
    .pth imports at interpreter start in ``elastictk-site/`` and a symlink at the report's name.
    The chaos run (root) must refuse the directory in one line, exit 2, before anything runs."""
    ran = shared / "ran"
    nobody(f"mkdir -m 0777 report report/elastictk-site && "
           f"echo 'open({str(ran)!r}, \"w\").write(\"ran\")' > report/elastictk-site/_distutils_hack.py && "
           f"cp report/elastictk-site/_distutils_hack.py report/elastictk-site/sitecustomize.py && "
           f"ln -s {victim} report/chaos-report.json && ln -s {victim} report/job-stdout.log", shared)
    report = shared / "report"
    code = chaos_cli.main(["--report-dir", str(report), "--faults", "0", "--standalone",
                           "--nproc-per-node", "1", "--", sys.executable, "-c", "print('step 1')"])
    err = one_line(capsys.readouterr().err)
    assert code == 2, err
    assert err.startswith(f"elastictk-chaos: error: --report-dir {report}: {report} is owned by user "
                          "id 65534"), err
    assert victim.read_text() == SECRET and not ran.exists()
    assert sorted(os.listdir(report)) == ["chaos-report.json", "elastictk-site", "job-stdout.log"]


def test_a_report_dir_others_can_write_is_refused_and_a_private_one_is_made(tmp_path: Path) -> None:
    from elastictk.chaos.flags import FlagError, report_dir

    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(FlagError, match=r"^--report-dir .*open: .*mode 0777\); run chmod go-w"):
        report_dir(str(tmp_path / "open"))
    made = report_dir(str(tmp_path / "new" / "r"))
    assert stat.S_IMODE(made.stat().st_mode) == 0o700 and made.stat().st_uid == os.geteuid()


def test_every_chaos_writer_replaces_a_planted_symlink_and_never_follows_it(
        tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    names = ["chaos-report.json", "job-stdout.log", "job-stderr.log", "chaos-plan.json",
             f".chaos-plan.json.tmp.{os.getpid()}", "chaos-faults.jsonl"]
    for n in names:
        (out / n).symlink_to(victim)
    _paths.write_file(out / "chaos-report.json", "{}\n")
    runner.keep_output(RunRecord(argv=[], started=0.0, stdout="out\n", stderr="err\n"), out)
    plan_of([Fault.of("exit:3", "rank:0", at_step=2)]).save(out / "chaos-plan.json")
    runner.fresh_log(out / "chaos-faults.jsonl")
    assert victim.read_text() == SECRET
    for n in ("chaos-report.json", "job-stdout.log", "job-stderr.log", "chaos-plan.json", "chaos-faults.jsonl"):
        assert not (out / n).is_symlink() and (out / n).is_file(), n
    assert (out / "job-stdout.log").read_text() == "out\n"
    assert [p for p in os.listdir(out) if p.endswith(".tmp")] == []  # no temporary file left
    # A worker appending to the fault log never follows a link planted there either.
    (out / "chaos-faults.jsonl").unlink()
    (out / "chaos-faults.jsonl").symlink_to(victim)
    monkeypatch.setenv(fenv.ENV_LOG, str(out / "chaos-faults.jsonl"))
    inworker._log({"fault": 0})
    assert victim.read_text() == SECRET and "cannot append" in capsys.readouterr().err


# -- finding 1: the workers' sitecustomize ------------------------------------------------------
def test_the_sitecustomize_lives_in_a_private_temp_dir_removed_at_the_end(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    with pytest.raises(ValueError, match=r"auto steps need site="):
        fenv.worker_env(plan, auto="optimizer")
    with pytest.raises(RuntimeError), fenv.private_site() as site:
        env = fenv.worker_env(plan, auto="optimizer", base_env={"PYTHONPATH": "/x"}, site=site)
        assert env["PYTHONPATH"] == os.pathsep.join([site, "/x"])
        st_ = os.lstat(site)
        assert stat.S_ISDIR(st_.st_mode) and st_.st_uid == os.geteuid() and stat.S_IMODE(st_.st_mode) == 0o700
        assert Path(site).parent == Path(tempfile.gettempdir()) and not Path(site).is_relative_to(tmp_path)
        assert os.listdir(site) == ["sitecustomize.py"]
        raise RuntimeError("the job failed")
    assert not os.path.lexists(site)  # removed also when the run failed


def test_run_job_removes_the_site_dir_when_the_run_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str | None] = []

    def failing(*args: object, site: str | None, **kw: object) -> RunRecord:
        seen.append(site)
        assert site is not None and os.path.isfile(os.path.join(site, "sitecustomize.py"))
        raise OSError("the launcher could not start")

    monkeypatch.setattr(runner, "_run_job", failing)
    plan = plan_of([Fault.of("exit:3", "rank:0", at_step=2)])
    with pytest.raises(OSError):
        runner.run_job(plan, [], ["x.py"], tmp_path, timeout=5)
    assert seen and seen[0] is not None and not os.path.lexists(seen[0])


# -- finding 3: --event-log and --log-dir -------------------------------------------------------
@as_root
def test_an_event_log_in_another_users_directory_never_follows_their_symlink(
        shared: Path, victim: Path) -> None:
    nobody(f"mkdir -m 0777 ev && ln -s {victim} ev/events.jsonl && ln -s {victim} planted.jsonl && "
           f"echo x > theirs.jsonl", shared)
    path = shared / "ev" / "events.jsonl"
    with pytest.raises(UsageError, match=rf"^--event-log {path}: {shared / 'ev'} is owned by user id 65534"):
        check_event_log(str(path))
    with pytest.raises(EventLogError, match=r"is owned by user id 65534"):
        EventLog(path).close()
    # In the sticky shared directory itself: their symlink and their file are refused too.
    for name, why in (("planted.jsonl", "is a symlink"), ("theirs.jsonl", "owned by user id 65534")):
        with pytest.raises(UsageError, match=why):
            check_event_log(str(shared / name))
        with pytest.raises(EventLogError, match=why):
            EventLog(shared / name).close()
    assert victim.read_text() == SECRET
    log = EventLog(shared / "mine.jsonl")  # a fresh file of this user's in /tmp is fine
    log("ok")
    log.close()
    assert (shared / "mine.jsonl").stat().st_uid == os.geteuid()


@as_root
def test_a_log_dir_another_user_can_write_is_refused(shared: Path) -> None:
    nobody("mkdir -m 0777 logs", shared)
    logs = shared / "logs"
    with pytest.raises(UsageError, match=rf"^--log-dir {logs}: {logs} is owned by user id 65534"):
        check_log_dir(str(logs))
    with pytest.raises(LogDirError, match=r"owned by user id 65534"):
        claim_run_dir(logs, "job")
    assert os.listdir(logs) == []


def test_elastictk_run_refuses_a_shared_log_dir_and_event_log_dir_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    script = tmp_path / "t.py"
    script.write_text("print('ran')\n")
    for flag, value in (("--log-dir", tmp_path / "open"), ("--event-log", tmp_path / "open" / "ev.jsonl")):
        r = subprocess.run([sys.executable, "-m", "elastictk.run", "--standalone", flag, str(value),
                            str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        line = one_line(r.stderr)
        assert r.returncode == 2 and f"{flag} {value}: " in line and "mode 0777); run chmod go-w" in line, r.stderr
        assert "ran" not in r.stdout
    assert os.listdir(tmp_path / "open") == []


# -- finding 8: --replay ------------------------------------------------------------------------
REPORT = '{"schema": "elastictk.chaos-report/1", "plan": {"faults": []}, "launcher_flags": ' \
         '["--nproc-per-node", "x"], "command": ["t.py"]}\n'


@as_root
def test_replay_refuses_a_report_another_user_wrote(shared: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (shared / "in").write_text(REPORT)
    nobody("cat in > theirs.json", shared)
    code = chaos_cli.main(["--replay", str(shared / "theirs.json")])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and f"--replay {shared / 'theirs.json'}: " in line and "owned by user id 65534" in line, line


def test_replay_refuses_a_report_others_can_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "mine.json"
    report.write_text(REPORT)
    report.chmod(0o666)
    assert chaos_cli.main(["--replay", str(report)]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"--replay {report}: " in line and "writable by group or others (mode 0666)" in line, line
    report.chmod(0o644)  # the passing side: the report is read, and its bad flag named
    assert chaos_cli.main(["--replay", str(report)]) == 2
    assert "owned" not in capsys.readouterr().err

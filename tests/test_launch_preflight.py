"""The machine checks elastictk-run makes before anything starts (elastictk.cli.preflight),
at unit level: each refusal is one line naming the flag, and each passing side passes and
leaves nothing behind. The end-to-end rows are in test_bad_input.py's LAUNCH_CASES."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.cli import UsageError, parse_args
from elastictk.cli.preflight import check_endpoint_hosts, check_event_log, check_writable_dir
from elastictk.run import main


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('ran')\n")
    return str(path)


def test_a_directory_where_no_directory_can_be_made_is_refused() -> None:
    with pytest.raises(UsageError, match=r"^--log-dir /proc/x: cannot create a directory in /proc"):
        check_writable_dir("/proc/x", "--log-dir")


def test_the_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    check_writable_dir(str(tmp_path / "new" / "logs"), "--log-dir")
    check_event_log(str(tmp_path / "events.jsonl"))
    assert list(tmp_path.iterdir()) == []


def test_event_log_paths(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match=r"is a directory; give a file path"):
        check_event_log(str(tmp_path))
    with pytest.raises(UsageError, match=rf"^--event-log {tmp_path}/f/a/ev: {tmp_path}/f is a file"):
        check_event_log(str(tmp_path / "f" / "a" / "ev"))
    with pytest.raises(UsageError, match=r"^--event-log /proc/x/ev: cannot create a directory in /proc"):
        check_event_log("/proc/x/ev")
    check_event_log(str(tmp_path / "f"))  # an existing log file is appended to


def test_host_names_are_checked_with_the_flag_they_came_from(script: str) -> None:
    c10d = parse_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "nohost.invalid:29400",
                       "--nnodes", "2", script], environ={})
    with pytest.raises(UsageError, match=r"^--rdzv-endpoint nohost.invalid:29400: cannot resolve host"):
        check_endpoint_hosts(c10d)
    static = parse_args(["--nnodes", "2", "--master-addr", "nohost.invalid", "--master-port",
                         "29555", "--node-rank", "1", script], environ={}, check=False)
    with pytest.raises(UsageError, match=r"^--master-addr nohost.invalid: cannot resolve host"):
        check_endpoint_hosts(static)
    etcd = parse_args(["--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:2379,nohost.invalid",
                       "--nnodes", "2", script], environ={}, check=False)
    with pytest.raises(UsageError, match=r"^--rdzv-endpoint nohost.invalid:2379: cannot resolve"):
        check_endpoint_hosts(etcd)
    for fine in (["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29400", "--nnodes", "2"],
                 ["--standalone"], []):
        check_endpoint_hosts(parse_args([*fine, script], environ={}, check=False))


def test_a_library_caller_gets_the_usage_error(script: str) -> None:
    with pytest.raises(UsageError, match="cannot resolve host nohost.invalid"):
        main(["--rdzv-backend", "c10d", "--rdzv-endpoint", "nohost.invalid:29400", "--nnodes", "2",
              script])


def test_a_directory_with_a_main_runs_as_python_runs_it(tmp_path: Path) -> None:
    pkg = tmp_path / "app"
    pkg.mkdir()
    (pkg / "__main__.py").write_text("print('app ran')\n")
    r = subprocess.run([sys.executable, "-m", "elastictk.run", str(pkg)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "app ran" in r.stdout, r.stderr[-2000:]


@settings(max_examples=60, deadline=None)
@given(ranks=st.lists(st.integers(0, 40), min_size=1, max_size=5), nproc=st.integers(1, 8))
def test_a_ranks_filter_is_within_the_local_ranks_or_refused(ranks: list[int], nproc: int) -> None:
    argv = ["--nproc-per-node", str(nproc), "--local-ranks-filter", ",".join(map(str, ranks)), "x.py"]
    if max(ranks) < nproc:
        config = parse_args(argv, environ={}, check=False)
        assert config.local_ranks_filter == frozenset(ranks)
        return
    with pytest.raises(UsageError) as info:
        parse_args(argv, environ={}, check=False)
    line = str(info.value)
    assert "\n" not in line and line.startswith("--local-ranks-filter ")
    assert f"rank {min(r for r in ranks if r >= nproc)} is not a local rank" in line
    assert f"0..{nproc - 1}" in line

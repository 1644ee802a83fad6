"""Issue #19, what a torchrun user sees, under ``torchrun`` and ``elastictk-run`` side by side.

Each item runs under both launchers (or both ``main`` functions, in-process) and the two are
compared: the console lines with torchrun's ``[role<local_rank>]:`` prefix and with
``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``, those lines captured from a library caller's
``sys.stdout``/``sys.stderr``, ``--logs-specs NAME`` loaded from a real ``torchrun.logs_specs``
entry point (a dist-info on ``PYTHONPATH``; the files it lays out, the environment its ``reify``
gives workers), an unknown name, the workers' count and ``pgrep -f script.py``. Runs are shared
across assertions and the two launchers run side by side.

The rest of #19 is compared with torch in its own module: ``main()``'s exceptions
(tests/test_run_main.py), ``--rdzv-conf`` splitting (tests/test_rdzv_conf_parity.py),
``--nproc-per-node`` through ``torch.accelerator`` (tests/test_nproc_devices.py), process
titles (tests/test_process_titles.py, whose ``pgrep`` helper is used here), every parsed flag
(tests/test_cli_args.py, whose torch reference is used here).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from elastictk.cli import UsageError, parse_args
from tests.test_cli_args import torch_reference
from tests.test_process_titles import _pgrep

ROOT = Path(__file__).resolve().parent.parent
LAUNCHERS = {"torchrun": "torch.distributed.run", "elastictk-run": "elastictk.run"}
TEMPLATE = "<${role_name}|${rank}|${local_rank}> "

PLUGIN = '''
import os
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std, to_map


class FlatLogsSpecs(LogsSpecs):
    """Every rank's files side by side: <log_dir>/r<rank>-a<restart>.{out,err,json}."""

    @property
    def root_log_dir(self):
        return str(self._root_log_dir)

    def reify(self, envs):
        n = len(envs)
        red, tee = to_map(self._redirects, n), to_map(self._tee, n)
        d = LogsDest()
        for lr, env in envs.items():
            base = os.path.join(self._root_log_dir,
                                f"r{env['RANK']}-a{env['TORCHELASTIC_RESTART_COUNT']}")
            both = red[lr] | tee[lr]
            d.stdouts[lr] = base + ".out" if both & Std.OUT else ""
            d.stderrs[lr] = base + ".err" if both & Std.ERR else ""
            if tee[lr] & Std.OUT:
                d.tee_stdouts[lr] = d.stdouts[lr]
            if tee[lr] & Std.ERR:
                d.tee_stderrs[lr] = d.stderrs[lr]
            d.error_files[lr] = base + ".json"
            env["TORCHELASTIC_ERROR_FILE"] = d.error_files[lr]
            env["FLAT_LOGS_BASE"] = base
        d.filtered_stdout = os.path.join(self._root_log_dir, "filtered.out")
        d.filtered_stderr = os.path.join(self._root_log_dir, "filtered.err")
        return d
'''

# Writes its pid under argv[1], waits for argv[1]/go (so pgrep sees it running), then prints.
WORKER = '''
import os, sys, time
marks = sys.argv[1]
open(os.path.join(marks, str(os.getpid())), "w").close()
while not os.path.exists(os.path.join(marks, "go")):
    time.sleep(0.02)
print("out", os.environ["RANK"], "of", os.environ["WORLD_SIZE"],
      os.environ.get("FLAT_LOGS_BASE", "-"), flush=True)
print("err", os.environ["LOCAL_RANK"], os.environ["TORCHELASTIC_ERROR_FILE"] != "",
      file=sys.stderr, flush=True)
'''

# Refused before anything starts; the library caller records what each main() raised.
BAD_ARGV = [["--standalone", "--logs-specs", "no-such-specs"],
            ["--standalone", "--no-python", "--module"],
            ["--standalone", "--nproc-per-node", "lots"],
            ["--standalone", "--bogus-flag"]]

# A library caller: main(argv) with sys.stdout/sys.stderr redirected to StringIO.
CALLER = '''
import contextlib, io, json, sys
which, bads, good = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
if which == "torchrun":
    from torch.distributed.run import main
else:
    from elastictk.run import main
result = {"bad": []}
for bad in bads:
    try:
        main(bad)
        result["bad"].append("returned")
    except ValueError:
        result["bad"].append("ValueError")
    except SystemExit as e:
        result["bad"].append(f"SystemExit({e.code})")
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    result["returned"] = main(good)
result["out"], result["err"] = out.getvalue(), err.getvalue()
print("RESULT " + json.dumps(result), flush=True)
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the ``flatlogs`` package and its dist-info: ``flat`` in the
    ``torchrun.logs_specs`` entry-point group, found by importlib.metadata on ``sys.path``."""
    path = tmp_path_factory.mktemp("site")
    (path / "flatlogs.py").write_text(PLUGIN)
    info = path / "flatlogs-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flatlogs\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[torchrun.logs_specs]\nflat = flatlogs:FlatLogsSpecs\n")
    return path


def _env(site: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "ELASTICTK_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), OMP_NUM_THREADS="1", **extra)
    return env


def _wait_marks(marks: Path, n: int, procs: list[subprocess.Popen[str]]) -> list[int]:
    deadline = time.monotonic() + 300  # generous: only a failure waits it out
    while len(list(marks.iterdir())) < n:
        assert time.monotonic() < deadline, f"{n} workers did not start under {marks}"
        assert all(p.poll() is None for p in procs), f"a launcher exited: {[p.args for p in procs]}"
        time.sleep(0.02)
    return sorted(int(p.name) for p in marks.iterdir())


def _normal(text: str, base: Path) -> str:
    """Output with this launcher's directory replaced, so the two launchers' can be compared."""
    return text.replace(str(base), "BASE")


@pytest.fixture(scope="module")
def cli_runs(site: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Both launchers from the command line, side by side, with the template, ``--tee 3`` and
    ``--logs-specs flat``: per launcher its console, its log files, and what pgrep saw."""
    procs: dict[str, subprocess.Popen[str]] = {}
    bases: dict[str, Path] = {}
    for name, module in LAUNCHERS.items():
        base = bases[name] = tmp_path_factory.mktemp(name)
        for sub in ("logs", "marks"):
            (base / sub).mkdir()
        script = base / "parity_train.py"
        script.write_text(WORKER)
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", module, "--standalone", "--nproc-per-node", "2", "--tee", "3",
             "--logs-specs", "flat", "--log-dir", str(base / "logs"),
             "--duplicate-stdout-filters", "out", str(script), str(base / "marks")],
            cwd=base, env=_env(site, TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=TEMPLATE),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs: dict[str, Any] = {}
    try:
        for name, base in bases.items():
            workers = _wait_marks(base / "marks", 2, list(procs.values()))
            runs[name] = {"workers": workers, "pgrep": _pgrep(str(base / "parity_train.py"))}
        for name, base in bases.items():
            (base / "marks" / "go").touch()
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            logs = bases[name] / "logs"
            runs[name].update(
                code=proc.returncode, out=_normal(out, bases[name]), err=_normal(err, bases[name]),
                files={p.name: _normal(p.read_text(), bases[name]) for p in logs.iterdir()
                       if p.is_file()})
        yield runs
    finally:  # workers left waiting (torchrun's outlive a killed launcher) are let go first
        for base in bases.values():
            (base / "marks" / "go").touch()
        for proc in procs.values():
            if proc.poll() is None:
                try:
                    proc.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.communicate()


def _prefixed(text: str, pattern: str) -> list[str]:
    return sorted(line for line in text.splitlines() if re.match(pattern, line))


def test_both_launchers_finish_with_the_same_workers(cli_runs: dict[str, Any]) -> None:
    ours, theirs = cli_runs["elastictk-run"], cli_runs["torchrun"]
    assert (ours["code"], theirs["code"]) == (0, 0), (ours["err"][-2000:], theirs["err"][-2000:])
    assert len(ours["workers"]) == len(theirs["workers"]) == 2


@pytest.mark.skipif(shutil.which("pgrep") is None, reason="pgrep (procps) is not installed")
def test_pgrep_script_finds_the_launcher_and_every_worker_under_both(cli_runs: dict[str, Any]) -> None:
    for name in LAUNCHERS:
        run = cli_runs[name]
        assert set(run["workers"]) <= run["pgrep"], (name, run)
    assert len(cli_runs["elastictk-run"]["pgrep"]) == len(cli_runs["torchrun"]["pgrep"])


def test_template_prefixes_tee_d_console_lines_as_torchrun(cli_runs: dict[str, Any]) -> None:
    ours, theirs = cli_runs["elastictk-run"], cli_runs["torchrun"]
    out = _prefixed(theirs["out"], r"<default\|")
    assert out == ["<default|0|0> out 0 of 2 BASE/logs/r0-a0", "<default|1|1> out 1 of 2 BASE/logs/r1-a0"]
    assert _prefixed(ours["out"], r"<default\|") == out
    err = _prefixed(theirs["err"], r"<default\|")
    assert err == ["<default|0|0> err 0 True", "<default|1|1> err 1 True"]
    assert _prefixed(ours["err"], r"<default\|") == err


def test_logs_specs_entry_point_decides_the_files_as_under_torchrun(cli_runs: dict[str, Any]) -> None:
    ours, theirs = cli_runs["elastictk-run"]["files"], cli_runs["torchrun"]["files"]
    assert sorted(theirs) == ["filtered.out", "r0-a0.err", "r0-a0.out", "r1-a0.err", "r1-a0.out"]
    assert theirs["r1-a0.out"] == "out 1 of 2 BASE/logs/r1-a0\n"  # raw: no prefix in the file
    # elastictk adds its event log to the run's directory (here the flat log dir), on purpose
    assert '"kind":"workers_started"' in ours.pop("events.jsonl")
    for files in (ours, theirs):  # ranks write the filtered file in whichever order they run
        files["filtered.out"] = sorted(files["filtered.out"].splitlines())
    assert ours == theirs  # the same names, the same contents, the filtered file prefixed


@pytest.fixture(scope="module")
def library_runs(site: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both ``main`` functions called in-process by a caller that redirects sys.stdout and
    sys.stderr: first with an unknown ``--logs-specs`` name, then a job with ``--tee 3``."""
    procs, bases = {}, {}
    for name in LAUNCHERS:
        base = bases[name] = tmp_path_factory.mktemp(f"lib-{name}")
        (base / "marks").mkdir()
        script = base / "parity_train.py"
        script.write_text(WORKER)
        (base / "marks" / "go").touch()  # no waiting: nothing here looks at the workers
        (base / "caller.py").write_text(CALLER)
        bad = [[*flags, str(script), str(base / "marks")] for flags in BAD_ARGV]
        good = ["--standalone", "--nproc-per-node", "2", "--tee", "3", "--log-dir",
                str(base / "logs"), str(script), str(base / "marks")]
        procs[name] = subprocess.Popen(
            [sys.executable, str(base / "caller.py"), name, json.dumps(bad), json.dumps(good)],
            cwd=base, env=_env(site), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            assert lines, out + err
            runs[name] = json.loads(lines[-1][len("RESULT "):])
            runs[name]["fd_out"] = out  # what reached the process's own stdout instead
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return runs


def test_bad_argv_raises_the_same_in_both_mains(library_runs: dict[str, Any]) -> None:
    theirs = library_runs["torchrun"]["bad"]
    assert theirs == ["ValueError", "ValueError", "ValueError", "SystemExit(2)"]
    assert library_runs["elastictk-run"]["bad"] == theirs


def test_a_library_caller_captures_the_prefixed_lines_as_from_torchrun(
        library_runs: dict[str, Any]) -> None:
    ours, theirs = library_runs["elastictk-run"], library_runs["torchrun"]
    assert ours["returned"] is None or ours["returned"] == 0
    out = _prefixed(theirs["out"], r"\[default\d\]:")
    assert out == ["[default0]:out 0 of 2 -", "[default1]:out 1 of 2 -"]
    assert _prefixed(ours["out"], r"\[default\d\]:") == out
    err = _prefixed(theirs["err"], r"\[default\d\]:")
    assert err == ["[default0]:err 0 True", "[default1]:err 1 True"]
    assert _prefixed(ours["err"], r"\[default\d\]:") == err
    for run in (ours, theirs):  # none went past the caller's streams to its fds
        assert not [ln for ln in run["fd_out"].splitlines() if ln.startswith("[default")]


def test_parsed_logs_specs_template_and_worker_count_equal_torchruns(site: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", TEMPLATE)
    argv = ["--standalone", "--nproc-per-node", "2", "--logs-specs", "flat", "--log-dir",
            str(tmp_path), "--redirects", "2", "--tee", "0:3,1:1", "--local-ranks-filter", "0",
            "train.py"]
    config, reference = parse_args(argv), torch_reference(argv)[1]
    assert config.log_line_prefix_template == reference.log_line_prefix_template == TEMPLATE
    ours, theirs = config.logs_specs, reference.logs_specs
    assert type(ours).__module__ == type(theirs).__module__ == "flatlogs"
    assert vars(ours) == vars(theirs)  # log dir, redirects, tee, ranks filter: torch's values
    with pytest.raises(UsageError) as bad:
        parse_args(["--logs-specs", "no-such-specs", "train.py"])
    assert re.fullmatch(r"--logs-specs no-such-specs: no entry point of that name in group "
                        r"'torchrun.logs_specs' \(installed: .*\bflat\b.*\); .*", str(bad.value))
    with pytest.raises(ValueError, match="no-such-specs"):
        torch_reference(["--logs-specs", "no-such-specs", "train.py"])
    for word in ("auto", "cpu", "3"):  # worker counts (accelerators: tests/test_nproc_devices.py)
        argv = ["--standalone", "--nproc-per-node", word, "train.py"]
        assert parse_args(argv).nproc_per_node == torch_reference(argv)[1].nproc_per_node

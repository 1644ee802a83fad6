"""A torch ``LogsSpecs`` (``--logs-specs``) decides where a worker group's logs go: the files,
the tee to a text console, the error file, what ``reify`` adds to the workers' environment, an
in-place replacement that writes where the class puts it; a ``reify`` that raises is one line.
The entry-point side and the comparison with torchrun are in tests/test_torchrun_parity.py."""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, LogsDest, LogsSpecs
from torch.distributed.elastic.multiprocessing.api import Std as TorchStd

from elastictk.supervisor.group import WorkerGroup
from elastictk.supervisor.logs import LogDirError, line_prefix
from elastictk.supervisor.spec import WorkerSpec
from tests.test_worker_group import assignment

ECHO = ["/bin/sh", "-c", 'echo "out $RANK $TORCHELASTIC_RESTART_COUNT $SPECS_SAW"; '
                         'echo "err $LOCAL_RANK" >&2; echo "$TORCHELASTIC_ERROR_FILE" > /dev/null']


class OneDir(LogsSpecs):
    """Every rank's stdout in ``<log_dir>/r<rank>.<restart>.out`` (tee'd), stderr to the console;
    tells each worker what it decided through ``SPECS_SAW``."""

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        d = LogsDest()
        for lr, env in envs.items():
            path = os.path.join(str(self._root_log_dir),
                                f"r{env['RANK']}.{env['TORCHELASTIC_RESTART_COUNT']}.out")
            d.stdouts[lr], d.stderrs[lr], d.tee_stdouts[lr] = path, "", path
            d.error_files[lr] = path + ".json"
            env["SPECS_SAW"] = f"seen{lr}"
        return d


class Broken(OneDir):
    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        raise KeyError("RANK")


def _group(spec: WorkerSpec, console: tuple[Any, Any]) -> WorkerGroup:
    return WorkerGroup(spec, None, console=console)


def test_reify_places_files_tees_to_a_text_console_and_sets_the_env(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    spec = WorkerSpec(ECHO, local_world_size=2, logs_specs=OneDir(str(tmp_path)),
                      log_line_prefix_template="<${rank}> ")
    with _group(spec, (out, err)) as g:
        g.start(0, assignment())
        results = g.wait(timeout=60)
        g.respawn(1, 1, "gen_1")  # in place: the class is asked again (restart count 1)
        assert g.wait(timeout=60)[1].exitcode == 0
        assert g.attempt_dir == tmp_path and g.run_log_dir == tmp_path
    assert all(r.exitcode == 0 for r in results.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r2.0.out", "r3.0.out", "r3.1.out"]
    assert (tmp_path / "r3.0.out").read_text() == "out 3 0 seen1\n"
    assert (tmp_path / "r3.1.out").read_text() == "out 3 1 seen1\n"
    assert results[1].stdout_path == str(tmp_path / "r3.0.out") and results[1].stderr_path is None
    assert sorted(out.getvalue().splitlines()) == ["<2> out 2 0 seen0", "<3> out 3 0 seen1",
                                                   "<3> out 3 1 seen1"]
    assert err.getvalue() == ""  # stderr went to the console as is (the process's fd 2)


def test_torchs_default_class_keeps_its_own_layout(tmp_path: Path) -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        spec = WorkerSpec(ECHO, local_world_size=1,
                          logs_specs=DefaultLogsSpecs(str(tmp_path), redirects=TorchStd.ALL))
        with _group(spec, (null, null)) as g:
            g.start(0, assignment(lws=1))
            result = g.wait(timeout=60)[0]
            attempt = g.attempt_dir
    finally:
        os.close(null)
    assert attempt is not None and attempt.name == "attempt_0" and attempt.parent.name.startswith("job_")
    assert Path(result.stdout_path or "") == attempt / "0" / "stdout.log"
    assert (attempt / "0" / "stdout.log").read_text() == "out 1 0 \n"
    assert (attempt / "0" / "stderr.log").read_text() == "err 0\n"


def test_a_reify_that_raises_is_one_line(tmp_path: Path) -> None:
    spec = WorkerSpec(ECHO, local_world_size=1, logs_specs=Broken(str(tmp_path)))
    with _group(spec, (None, None)) as g:
        with pytest.raises(LogDirError) as e:
            g.start(0, assignment(lws=1))
        assert g.pids() == {}
    assert str(e.value) == ("--logs-specs Broken.reify failed: KeyError: 'RANK'; fix the LogsSpecs "
                            "class or leave --logs-specs out")


@pytest.mark.parametrize("template,expected", [
    (None, "[trainer1]:"),
    ("", "[trainer1]:"),  # torchrun: an empty TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE is none
    ("[${role_name}${rank}|${local_rank}]:", "[trainer7|1]:"),
    ("${rank} ${unknown} $$ ", "7 ${unknown} $ "),  # safe_substitute, as torchrun's agent
])
def test_the_prefix_is_filled_in_as_torchruns_agent_fills_it(template: str | None, expected: str) -> None:
    spec = WorkerSpec(ECHO, local_world_size=2, role="trainer", log_line_prefix_template=template)
    assert line_prefix(spec, 1, 7) == expected

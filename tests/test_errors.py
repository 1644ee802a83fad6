"""Error files: ``@elastictk.record`` in real worker processes, torch compatibility both ways,
and a reader that turns every bad file into one line naming it."""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import elastictk
from elastictk.supervisor.errors import (
    ERROR_FILE_ENV,
    ErrorFileUnreadable,
    ErrorRecord,
    exception_payload,
    parse_error_payload,
    read_error_file,
    record,
    record_exception,
    write_error_file,
)

TIMEOUT = 120  # generous: a loaded machine imports torch slowly

WORKER = """
import sys
{imports}

def helper(n):
    raise ValueError(f"boom {{n}}")

@{decorator}
def main():
    mode = sys.argv[1]
    if mode == "raise":
        helper(42)
    if mode == "exit0":
        sys.exit(0)
    if mode == "exit3":
        sys.exit(3)
    if mode == "chained":
        try:
            helper(1)
        except ValueError as e:
            raise RuntimeError("while handling") from e
    if mode == "segv":
        import ctypes
        def crash():
            ctypes.string_at(0)
        crash()
    print("ok")

if __name__ == "__main__":
    main()
"""

OURS = {"imports": "import elastictk", "decorator": "elastictk.record"}
TORCHS = {"imports": "from torch.distributed.elastic.multiprocessing.errors import record",
          "decorator": "record"}


def run_worker(tmp_path: Path, flavour: dict[str, str], mode: str, *,
               error_file: Path | None) -> subprocess.CompletedProcess[str]:
    script = tmp_path / f"worker_{flavour['decorator'].replace('.', '_')}.py"
    script.write_text(WORKER.format(**flavour))
    env = {k: v for k, v in os.environ.items() if k != ERROR_FILE_ENV}
    if error_file is not None:
        env[ERROR_FILE_ENV] = str(error_file)
    env.pop("PYTHONFAULTHANDLER", None)
    return subprocess.run([sys.executable, str(script), mode], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=TIMEOUT)


def test_exported_at_top_level() -> None:
    assert elastictk.record is record


def test_script_worker_writes_torch_shaped_file(tmp_path: Path) -> None:
    ef = tmp_path / "error.json"
    before = int(time.time())
    proc = run_worker(tmp_path, OURS, "raise", error_file=ef)
    after = int(time.time())
    assert proc.returncode == 1
    assert "ValueError: boom 42" in proc.stderr  # re-raised: the traceback still reaches stderr
    raw = json.loads(ef.read_text())
    assert set(raw) == {"message"}
    assert set(raw["message"]) == {"message", "extraInfo"}
    assert set(raw["message"]["extraInfo"]) == {"py_callstack", "timestamp"}
    assert raw["message"]["message"] == "ValueError: boom 42"
    stamp = raw["message"]["extraInfo"]["timestamp"]
    assert isinstance(stamp, str) and before <= int(stamp) <= after
    rec = read_error_file(str(ef))
    assert rec is not None
    assert rec.message == "ValueError: boom 42"
    assert rec.timestamp == int(stamp)
    assert rec.traceback is not None
    assert rec.traceback.startswith("Traceback (most recent call last):")
    assert "in helper" in rec.traceback and rec.traceback.rstrip().endswith("ValueError: boom 42")
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_chained_exception_keeps_both_tracebacks(tmp_path: Path) -> None:
    ef = tmp_path / "error.json"
    proc = run_worker(tmp_path, OURS, "chained", error_file=ef)
    assert proc.returncode == 1
    rec = read_error_file(str(ef))
    assert rec is not None and rec.message == "RuntimeError: while handling"
    assert rec.traceback is not None and "ValueError: boom 1" in rec.traceback
    assert "direct cause" in rec.traceback


def test_same_file_as_torch_record(tmp_path: Path) -> None:
    """Both decorators, same worker: same message, same traceback text bar the file path."""
    ours, theirs = tmp_path / "ours.json", tmp_path / "theirs.json"
    assert run_worker(tmp_path, OURS, "raise", error_file=ours).returncode == 1
    assert run_worker(tmp_path, TORCHS, "raise", error_file=theirs).returncode == 1
    a, b = json.loads(ours.read_text()), json.loads(theirs.read_text())
    assert a["message"]["message"] == b["message"]["message"] == "ValueError: boom 42"

    def frames(d: dict[str, Any]) -> list[str]:  # the code lines, which do not name the script
        lines = d["message"]["extraInfo"]["py_callstack"].splitlines()
        return [ln.strip() for ln in lines if not ln.strip().startswith("File ")]

    # torch's wrapper adds its own frame ("return f(*args, **kwargs)"), as ours does.
    assert frames(a)[0] == frames(b)[0] == "Traceback (most recent call last):"
    assert frames(a)[-3:] == frames(b)[-3:]
    assert type(a["message"]["extraInfo"]["timestamp"]) is type(b["message"]["extraInfo"]["timestamp"])


def test_we_read_a_file_written_by_torch(tmp_path: Path) -> None:
    ef = tmp_path / "error.json"
    proc = run_worker(tmp_path, TORCHS, "raise", error_file=ef)
    assert proc.returncode == 1
    rec = read_error_file(str(ef))
    assert rec is not None
    assert rec.message == "ValueError: boom 42"
    assert rec.traceback is not None and "in helper" in rec.traceback
    assert rec.timestamp is not None and abs(rec.timestamp - time.time()) < 3600


def test_torch_reads_a_file_written_by_us(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    ef = tmp_path / "error.json"
    proc = run_worker(tmp_path, OURS, "raise", error_file=ef)
    assert proc.returncode == 1
    failure = ProcessFailure(local_rank=0, pid=4242, exitcode=1, error_file=str(ef))
    assert isinstance(failure.message, dict)
    assert failure.message["message"] == "ValueError: boom 42"
    assert failure.timestamp == int(json.loads(ef.read_text())["message"]["extraInfo"]["timestamp"])
    text = ChildFailedError("worker", {0: failure}).format_msg()
    assert "ValueError: boom 42" in text and "in helper" in text


@pytest.mark.parametrize("flavour", [OURS, TORCHS], ids=["elastictk", "torch"])
def test_clean_exit_codes_write_nothing(tmp_path: Path, flavour: dict[str, str]) -> None:
    ef = tmp_path / "error.json"
    assert run_worker(tmp_path, flavour, "exit0", error_file=ef).returncode == 0
    assert run_worker(tmp_path, flavour, "exit3", error_file=ef).returncode == 3
    ok = run_worker(tmp_path, flavour, "ok", error_file=ef)
    assert ok.returncode == 0 and ok.stdout.strip() == "ok"
    assert not ef.exists()


def test_without_the_env_var_nothing_is_written_and_the_error_still_raises(tmp_path: Path) -> None:
    proc = run_worker(tmp_path, OURS, "raise", error_file=None)
    assert proc.returncode == 1 and "ValueError: boom 42" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker_elastictk_record.py"]


def test_unwritable_error_file_does_not_hide_the_workers_exception(tmp_path: Path) -> None:
    ef = tmp_path / "no-such-dir" / "error.json"
    proc = run_worker(tmp_path, OURS, "raise", error_file=ef)
    assert proc.returncode == 1
    assert "ValueError: boom 42" in proc.stderr
    assert f"could not write error file {ef}" in proc.stderr
    assert not ef.exists()


def test_segfault_leaves_a_python_stack_on_stderr(tmp_path: Path) -> None:
    ef = tmp_path / "error.json"
    proc = run_worker(tmp_path, OURS, "segv", error_file=ef)
    assert proc.returncode == -11
    assert "Fatal Python error: Segmentation fault" in proc.stderr
    assert "in crash" in proc.stderr and "in main" in proc.stderr
    assert not ef.exists()  # no Python ran after the fault; the stack is on stderr


# A function worker: the supervisor runs a function in a fresh interpreter (spawn), not a script.
@record
def function_worker(n: int) -> None:
    raise KeyError(f"missing shard {n}")


def test_function_worker_in_a_spawned_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ef = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(ef))
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=function_worker, args=(7,))
    p.start()
    p.join(TIMEOUT)
    if p.exitcode is None:
        p.kill()
        p.join(10)
        pytest.fail("function worker did not exit")
    assert p.exitcode == 1
    rec = read_error_file(str(ef))
    assert rec is not None and rec.message == "KeyError: 'missing shard 7'"
    assert rec.traceback is not None and "in function_worker" in rec.traceback


def test_in_process_call_records_and_reraises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ef = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(ef))
    with pytest.raises(KeyError):
        function_worker(3)
    rec = read_error_file(str(ef))
    assert rec is not None and rec.message == "KeyError: 'missing shard 3'"

    @record
    def fine(x: int) -> int:
        return x * 2

    assert fine(21) == 42
    assert record(fine) is fine and record(function_worker) is function_worker


def test_record_exception_explicit_path_and_no_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ERROR_FILE_ENV, raising=False)
    assert record_exception(ValueError("x")) is False
    ef = tmp_path / "e.json"
    assert record_exception(ValueError("x"), str(ef)) is True
    rec = read_error_file(str(ef))
    assert rec is not None and rec.message == "ValueError: x"


# ---------------------------------------------------------------- the reader on bad files
def _real_file(tmp_path: Path) -> bytes:
    try:
        raise ValueError("boom")
    except ValueError as e:
        return json.dumps(exception_payload(e, timestamp=1_700_000_000)).encode()


@pytest.mark.parametrize(
    "content,why",
    [
        (b"", "empty"),
        (b"  \n", "empty"),
        (b"\x00\xff\xfegarbage", "not valid JSON"),
        (b"[1, 2]", "top level is list"),
        (b'{"foo": 1}', "no 'message' field"),
        (b'{"message": 3}', "'message' is int"),
        (b'{"message": {"extraInfo": {}}}', "neither a message nor a py_callstack"),
    ],
)
def test_bad_files_name_the_path(tmp_path: Path, content: bytes, why: str) -> None:
    ef = tmp_path / "error.json"
    ef.write_bytes(content)
    with pytest.raises(ErrorFileUnreadable) as ei:
        read_error_file(str(ef))
    assert why in str(ei.value)
    assert str(ef) in str(ei.value) and "\n" not in str(ei.value)


def test_truncated_file(tmp_path: Path) -> None:
    ef = tmp_path / "error.json"
    blob = _real_file(tmp_path)
    ef.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ErrorFileUnreadable, match="truncated"):
        read_error_file(str(ef))


def test_missing_file_is_none_and_directory_is_unreadable(tmp_path: Path) -> None:
    assert read_error_file(str(tmp_path / "nope.json")) is None
    with pytest.raises(ErrorFileUnreadable, match="directory"):
        read_error_file(str(tmp_path))


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    ef = tmp_path / "error.json"
    os.mkfifo(ef)
    with pytest.raises(ErrorFileUnreadable, match="not a regular file"):
        read_error_file(str(ef))


def test_unreadable_permissions(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads files regardless of mode")
    ef = tmp_path / "error.json"
    ef.write_bytes(_real_file(tmp_path))
    ef.chmod(0)
    with pytest.raises(ErrorFileUnreadable, match="PermissionError"):
        read_error_file(str(ef))


def test_torch_flat_form_and_error_code() -> None:
    rec = parse_error_payload({"message": "exploded", "timestamp": 17})
    assert rec == ErrorRecord(message="exploded", timestamp=17)
    rec = parse_error_payload({"message": {"message": "E: x", "errorCode": -11,
                                           "extraInfo": {"timestamp": "12"}}})
    assert (rec.message, rec.error_code, rec.timestamp, rec.traceback) == ("E: x", -11, 12, None)


def test_write_error_file_is_atomic_and_overwrites(tmp_path: Path) -> None:
    ef = tmp_path / "error.json"
    write_error_file(str(ef), {"message": "one"})
    write_error_file(str(ef), {"message": "two"})
    assert json.loads(ef.read_text()) == {"message": "two"}
    assert os.listdir(tmp_path) == ["error.json"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["message", "extraInfo", "py_callstack", "timestamp", "errorCode", "x"]),
        inner, max_size=4),
    max_leaves=12,
)


@given(json_values)
@settings(max_examples=300)
def test_any_json_parses_or_fails_with_one_line(data: Any) -> None:
    try:
        rec = parse_error_payload(data, "/p/error.json")
    except ErrorFileUnreadable as e:
        assert str(e).startswith("error file /p/error.json is unreadable: ") and "\n" not in str(e)
    else:
        assert isinstance(rec.message, str)
        assert rec.timestamp is None or isinstance(rec.timestamp, int)


_DIRS: dict[str, Path] = {}


def _bytes_dir(factory: pytest.TempPathFactory) -> Path:
    if "d" not in _DIRS or not _DIRS["d"].exists():
        _DIRS["d"] = factory.mktemp("bytes")
    return _DIRS["d"]


@given(st.binary(max_size=200))
@settings(max_examples=150, deadline=None)
def test_any_bytes_read_or_fail_with_one_line(tmp_path_factory: pytest.TempPathFactory, blob: bytes) -> None:
    ef = _bytes_dir(tmp_path_factory) / "error.json"
    ef.write_bytes(blob)
    try:
        read_error_file(str(ef))
    except ErrorFileUnreadable as e:
        assert str(ef) in str(e)

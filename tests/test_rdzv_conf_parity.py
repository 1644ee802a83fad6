"""``--rdzv-conf`` is split exactly as torch's ``_parse_rendezvous_config`` splits it, on every
string torch accepts, refused (one line) where torch refuses; and a value passed with its quotes
(a Python argv list, a YAML launcher) means what the shell would have made of it."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

from elastictk.cli import parse_args
from elastictk.cli.values import UsageError, split_rdzv_conf

SCRIPT = "train.py"
# Keys and values of the alphabets a conf string is written in, with the separators and the
# whitespace and quotes that trip parsers up.
pieces = st.text(alphabet="ab_1.= ,\t'\"", max_size=30)


def _ours(text: str) -> dict[str, str] | None:
    try:
        return dict(split_rdzv_conf(text))
    except UsageError:
        return None


def _torch(text: str) -> dict[str, str] | None:
    try:
        return _parse_rendezvous_config(text)
    except ValueError:
        return None


@settings(max_examples=400, deadline=None)
@given(pieces)
def test_the_split_equals_torchs_on_any_string(text: str) -> None:
    stripped = text.strip()
    quoted = len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\""
    if quoted:  # torch keeps the quotes in the first key and the last value: compare unquoted
        assert _ours(text) == _torch(stripped[1:-1])
    else:
        assert _ours(text) == _torch(text)


@pytest.mark.parametrize("text", ["", "  ", "a=1", " a = 1 , b=2", "a=b=c", "a=1,a=2"])
def test_examples_split_like_torch(text: str) -> None:
    assert _ours(text) == _torch(text)


@pytest.mark.parametrize("text", [",", "a", "a=", "=1", "a=1,,b=2", "a=1, "])
def test_both_refuse_the_same_strings(text: str) -> None:
    assert _torch(text) is None and _ours(text) is None


@pytest.mark.parametrize("quote", ["'", '"'])
def test_a_value_passed_with_its_quotes_means_what_the_shell_would_make_of_it(
        quote: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / SCRIPT).write_text("pass\n")
    conf = parse_args(["--rdzv-conf", f"{quote}join_timeout=5,last_call_timeout=1{quote}",
                       "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", SCRIPT]).rdzv_conf
    assert conf["join_timeout"] == 5.0 and conf["last_call_timeout"] == 1.0

"""Slurm's node list syntax: the parser against a reference expansion (hypothesis), Slurm's
own examples, and hostile lists refused in one line, never a hang or a memory blow-up."""
from __future__ import annotations

import itertools
import os
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.slurm import MAX_HOSTS, NodelistError, expand, scontrol_hostnames

# A name part: what host names hold, never a bracket or a comma.
_PART = st.text(alphabet="abcgnopr-._", min_size=1, max_size=6)


@st.composite
def _bracket(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A bracket group's text and its reference expansion, built from the numbers drawn."""
    pieces, out = [], []
    for _ in range(draw(st.integers(1, 3))):
        width = draw(st.integers(1, 4))
        lo = draw(st.integers(0, 10 ** width - 1))
        if draw(st.booleans()):
            hi = draw(st.integers(lo, lo + 12))
            pieces.append(f"{lo:0{width}d}-{hi}")
            out += [f"{n:0{width}d}" for n in range(lo, hi + 1)]
        else:
            pieces.append(f"{lo:0{width}d}")
            out.append(f"{lo:0{width}d}")
    return "[" + ",".join(pieces) + "]", out


@st.composite
def _item(draw: st.DrawFn) -> tuple[str, list[str]]:
    """One name: a prefix, then bracket groups and name parts; the reference is the product."""
    texts = [draw(_PART)]
    choices = [[texts[0]]]
    for _ in range(draw(st.integers(0, 2))):
        text, hosts = draw(_bracket())
        texts.append(text)
        choices.append(hosts)
        if draw(st.booleans()):
            part = draw(_PART)
            texts.append(part)
            choices.append([part])
    return "".join(texts), ["".join(c) for c in itertools.product(*choices)]


@given(st.lists(_item(), min_size=1, max_size=4))
@settings(max_examples=300, deadline=None)
def test_expansion_matches_the_reference(items: list[tuple[str, list[str]]]) -> None:
    text = ",".join(t for t, _ in items)
    assert expand(text) == [h for _, hosts in items for h in hosts]


@pytest.mark.parametrize("text,hosts", [
    ("node[01-03,07],gpu-a[1-2]", ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]),
    ("localhost", ["localhost"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a,b[3],c", ["a", "b3", "c"]),
    ("rack1-node[001-002].cluster", ["rack1-node001.cluster", "rack1-node002.cluster"]),
])
def test_slurms_examples(text: str, hosts: list[str]) -> None:
    assert expand(text) == hosts


@pytest.mark.parametrize("text,says", [
    ("", "empty"), ("node[1-3", "without ']'"), ("node1-3]", "without '['"),
    ("n[[1]]", "nested"), ("n[3-1]", "backwards"), ("n[a-b]", "not a number"),
    ("n[]", "not a number"), ("a,,b", "empty name"), ("n 1", "not part of a host name"),
    ("n[0-999999999]", f"more than {MAX_HOSTS}"), ("n[0-99999]x[0-99999]", f"more than {MAX_HOSTS}"),
    ("n[1-2:2]", "not a number"), ("nö[1]", "not part of a host name"),
    # past Python's 4,300-digit int limit: was a ValueError traceback from int()
    ("a[1-" + "9" * 5000 + "]", "a number of 5000 digits"), ("a[" + "1" * 19 + "]", "19 digits"),
])
def test_malformed_lists_are_one_line(text: str, says: str) -> None:
    with pytest.raises(NodelistError) as e:
        expand(text)
    assert says in str(e.value) and "\n" not in str(e.value)


@given(st.text(max_size=60))
@settings(max_examples=500, deadline=None)
def test_any_text_expands_or_is_refused_in_one_line(text: str) -> None:
    try:
        hosts = expand(text)
    except NodelistError as e:
        assert "\n" not in str(e).replace("\\n", "")
        return
    assert 1 <= len(hosts) <= MAX_HOSTS and all(h for h in hosts)


@given(st.lists(st.sampled_from(["[", "]", ",", "-", "0", "9", "n", "00", "[0-9999]", "9" * 4400]),
                max_size=30))
@settings(max_examples=300, deadline=None)
def test_bracket_soup_is_bounded(pieces: list[str]) -> None:
    try:
        assert len(expand("".join(pieces))) <= MAX_HOSTS
    except NodelistError:
        pass


def _fake_scontrol(tmp_path: Path, body: str) -> dict[str, str]:
    exe = tmp_path / "bin" / "scontrol"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{exe.parent}:{os.environ['PATH']}"}


def test_scontrol_is_asked_when_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _fake_scontrol(tmp_path, 'test "$1 $2" = "show hostnames" && printf "x1\\nx2\\n"\n')
    monkeypatch.setenv("PATH", env["PATH"])
    assert scontrol_hostnames("x[1-2]") == ["x1", "x2"]


def test_scontrol_that_fails_counts_as_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", _fake_scontrol(tmp_path, "echo nope >&2; exit 1\n")["PATH"])
    assert scontrol_hostnames("x[1-2]") is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert scontrol_hostnames("x[1-2]") is None

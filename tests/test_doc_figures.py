"""One number, one place: every speed figure the README and docs/ quote comes from a report in
``bench/results/``, so a rerun benchmark cannot leave an old figure standing on another page.

What counts as a quoted figure: a ratio written ``×N`` (the form the benchmark reports use:
"×87.59 faster"), anywhere; and every timing (``N µs|ms|s``) in a table row that quotes such a
ratio (the side-by-side tables). A quoted value matches a reported one when it is that value
rounded to the quoted precision (``×88`` for ×87.59, ``×4,800`` for ×4767.50, ``0.060 s`` for
0.0597). A target or a description that is no measurement is written without ``×``
("10 times faster", "3.7x slower").
"""
from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NUM = r"(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)"
RATIO = re.compile("×" + NUM)
TIMING = re.compile(NUM + r"\s?(µs|ms|s)\b")
SCALE = {"µs": Decimal("0.000001"), "ms": Decimal("0.001"), "s": Decimal(1)}


def _number(text: str) -> Decimal:
    return Decimal(text.replace(",", ""))


def _tolerance(text: str) -> Decimal:
    """Half a unit of the last significant digit quoted: 88 -> 0.5, 0.060 -> 0.0005,
    4,800 -> 50 (zeros ending a whole number past its first two digits are rounding)."""
    digits = text.replace(",", "")
    if "." in digits:
        return Decimal(5) / Decimal(10) ** (len(digits.split(".")[1]) + 1)
    # a whole number keeps at least two significant digits: 90 is 90, 780 may be 776.2
    zeros = min(len(digits) - len(digits.rstrip("0")), max(len(digits) - 2, 0)) if digits.strip("0") else 0
    return Decimal(5) * Decimal(10) ** zeros / 10


def reported(results: list[str]) -> tuple[set[Decimal], set[Decimal]]:
    """The ratios, and every number (as seconds, for each unit it may be in), of the reports."""
    text = "\n".join(results)
    ratios = {_number(m.group(1)) for m in RATIO.finditer(text)}
    numbers = {_number(m.group(1)) for m in re.finditer(NUM, text)}
    seconds = {n * s for n in numbers for s in (*SCALE.values(), Decimal("1e-9"))}  # ns too
    return ratios, seconds


def misquoted(page: str, ratios: set[Decimal], seconds: set[Decimal]) -> list[str]:
    """The figures on ``page`` (Markdown) that no report holds, as ``line N: figure``."""
    bad: list[str] = []
    for n, line in enumerate(page.splitlines(), 1):
        quoted = list(RATIO.finditer(line))
        for m in quoted:
            q, tol = _number(m.group(1)), _tolerance(m.group(1))
            if not any(abs(r - q) <= tol for r in ratios):
                bad.append(f"line {n}: {m.group(0)}")
        if quoted and line.lstrip().startswith("|"):
            for m in TIMING.finditer(line):
                q = _number(m.group(1)) * SCALE[m.group(2)]
                tol = _tolerance(m.group(1)) * SCALE[m.group(2)]
                if not any(abs(v - q) <= tol for v in seconds):
                    bad.append(f"line {n}: {m.group(0)}")
    return bad


@pytest.fixture(scope="module")
def results() -> tuple[set[Decimal], set[Decimal]]:
    return reported([p.read_text() for p in sorted((ROOT / "bench" / "results").glob("*.md"))])


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_quoted_figure_is_in_a_benchmark_report(
        page: Path, results: tuple[set[Decimal], set[Decimal]]) -> None:
    bad = misquoted(page.read_text(), *results)
    assert not bad, (f"{page.relative_to(ROOT)} quotes figures no report in bench/results/ holds "
                     f"(rerun the benchmark or quote the report): {bad}")


def test_the_check_sees_a_figure_that_is_not_reported() -> None:
    ratios, seconds = reported(["| x | 0.0597 | 5.26 | ×88.06 faster |", "median 12.5 ms, ×4767.50 faster"])
    assert misquoted("| a | 0.060 s | 5.26 s | ×88 faster |\nabout ×4,800 faster", ratios, seconds) == []
    assert misquoted("in place ×90 faster", ratios, seconds) == ["line 1: ×90"]
    assert misquoted("| a | 0.075 s | 5.26 s | ×88 |", ratios, seconds) == ["line 1: 0.075 s"]
    assert misquoted("| a | 12.5 ms | 5.5 s | ×88 |", ratios, seconds) == ["line 1: 5.5 s"]
    assert misquoted("×4,900 faster", ratios, seconds) == ["line 1: ×4,900"]

"""Endpoint parsing shared by the stores and the CLI."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastictk.store import Endpoint, EndpointError, parse_endpoint


@pytest.mark.parametrize(
    "text,expected",
    [
        ("localhost", Endpoint("localhost", 29400)),
        ("node-1.cluster:1234", Endpoint("node-1.cluster", 1234)),
        ("127.0.0.1:0", Endpoint("127.0.0.1", 0)),
        ("[::1]:29500", Endpoint("::1", 29500)),
        ("[fe80::1]", Endpoint("fe80::1", 29400)),
        ("::1", Endpoint("::1", 29400)),
    ],
)
def test_accepted_forms(text: str, expected: Endpoint) -> None:
    assert parse_endpoint(text, default_port=29400) == expected


@pytest.mark.parametrize(
    "text,why",
    [
        ("", "empty"),
        ("host:", "not a number"),
        ("host:abc", "not a number"),
        ("host:70000", "out of range"),
        ("[::1", "missing"),
        ("[nothex]:1", "not an IPv6"),
        ("fe80::1:99999x", "bracketed"),
        ("tcp://host:1", "scheme"),
        ("bad host:1", "not a valid hostname"),
        ("-host:1", "not a valid hostname"),
    ],
)
def test_rejected_forms_say_why_in_one_line(text: str, why: str) -> None:
    with pytest.raises(EndpointError) as e:
        parse_endpoint(text, default_port=1)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_missing_port_without_default() -> None:
    with pytest.raises(EndpointError, match="no port"):
        parse_endpoint("host")


@given(st.from_regex(r"[a-z][a-z0-9\-]{0,20}[a-z0-9]", fullmatch=True), st.integers(0, 65535))
def test_round_trip(host: str, port: int) -> None:
    ep = Endpoint(host, port)
    assert parse_endpoint(str(ep)) == ep

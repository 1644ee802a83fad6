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


def test_quiet_port_is_free_and_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below the range no bind(0) or outgoing connect of another process can draw it between
    the pick and a child's bind (a CI run lost a chaos node 0 to exactly that)."""
    import socket

    import elastictk.store.endpoint as ep

    low = ep._ephemeral_low()
    if low is None or low < 21000:
        pytest.skip(f"this kernel's ephemeral range starts at {low}: quiet_port falls back to free_port")
    picked = {ep.quiet_port() for _ in range(20)}
    assert all(20000 <= p < low and p not in ep._DEFAULT_PORTS for p in picked), picked
    assert len(picked) > 1, "one port every time: the pick is not random, two callers would collide"
    with socket.socket() as s:
        s.bind(("127.0.0.1", picked.pop()))  # free: bindable
    # The failing side: free_port's own pick is inside the range.
    assert ep.free_port() >= low
    # A range that cannot be read: the plain free port, never an error.
    monkeypatch.setattr(ep, "_ephemeral_low", lambda: None)
    assert ep.quiet_port() >= low


def test_quiet_port_skips_a_port_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    import elastictk.store.endpoint as ep

    if ep._ephemeral_low() is None:
        pytest.skip("no ephemeral range to pick below")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        draws, real = iter([taken, 29400]), ep._rng.randrange
        monkeypatch.setattr(ep._rng, "randrange", lambda a, b: next(draws, None) or real(a, b))
        assert ep.quiet_port() not in (taken, 29400)
        assert next(draws, None) is None, "the taken and the default port were never drawn"

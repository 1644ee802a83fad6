"""Waiting on descriptors numbered past select(2)'s 1024 limit, which a long-lived agent reaches."""
from __future__ import annotations

import os
import resource
import select
import socket
from typing import Iterator

import pytest

from elastictk.lifetime.ready import readable

HIGH = 1500


@pytest.fixture
def high_pipe() -> Iterator[tuple[int, int]]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= HIGH + 1:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below {HIGH + 2}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, HIGH + 2), hard))
    r, w = os.pipe()
    os.dup2(r, HIGH)
    os.close(r)
    try:
        yield HIGH, w
    finally:
        for fd in (HIGH, w):
            try:
                os.close(fd)
            except OSError:
                pass
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_descriptor_past_1024_is_waited_on(high_pipe: tuple[int, int]) -> None:
    r, w = high_pipe
    with pytest.raises(ValueError, match="out of range"):
        select.select([r], [], [], 0)  # what the agent died of
    assert readable([r], 0) == []
    assert readable([r], 0.05) == []
    os.write(w, b"x")
    assert readable([r], 1.0) == [r]


def test_end_of_file_and_objects_read_as_ready() -> None:
    a, b = socket.socketpair()
    try:
        assert readable([a], 0) == []
        b.close()  # end of file: ready, as select says
        assert readable([a], 1.0) == [a]
    finally:
        a.close()
    assert readable([], 0) == []

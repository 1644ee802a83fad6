"""``elastictk.run`` offers what scripts import from ``torch.distributed.run`` besides ``main``:
``parse_min_max_nnodes`` (torch's launcher tests call it), with torch's error type."""
from __future__ import annotations

import pytest
import torch.distributed.run as torch_run

import elastictk.run as run


@pytest.mark.parametrize("text", ["1", "2:20", "3:3"])
def test_parse_min_max_nnodes_answers_as_torch(text: str) -> None:
    assert run.parse_min_max_nnodes(text) == torch_run.parse_min_max_nnodes(text)


@pytest.mark.parametrize("text", ["2:20:30", "a", "0:2", "3:1"])
def test_parse_min_max_nnodes_refuses_with_a_runtime_error(text: str) -> None:
    with pytest.raises(RuntimeError):
        run.parse_min_max_nnodes(text)

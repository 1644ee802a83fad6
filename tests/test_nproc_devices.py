"""``--nproc-per-node auto/gpu/xpu/<backend>`` counts devices as torchrun 2.13 does, through
``torch.accelerator`` (CUDA, XPU, MPS, HPU, PrivateUse1 backends), tested by patching torch as
one would for a device this machine lacks, side by side with torch's own
``determine_local_world_size``."""
from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
import torch
from torch.distributed.run import determine_local_world_size

from elastictk.cli import parse_args
from elastictk.cli.values import UsageError

SCRIPT = "train.py"


@pytest.fixture(autouse=True)
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / SCRIPT).write_text("pass\n")


def nproc(word: str) -> int:
    return parse_args(["--standalone", "--nproc-per-node", word, SCRIPT]).nproc_per_node


def test_auto_counts_the_accelerators_torch_accelerator_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 3)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("xpu"))
    assert nproc("auto") == determine_local_world_size("auto") == 3


def test_auto_without_an_accelerator_counts_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert nproc("auto") == len(os.sched_getaffinity(0)) == determine_local_world_size("auto")


def test_xpu_counts_xpus_and_refuses_without_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 2)
    assert nproc("xpu") == determine_local_world_size("xpu") == 2
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    with pytest.raises(UsageError, match="XPU is not available"):
        nproc("xpu")
    with pytest.raises(ValueError):
        determine_local_world_size("xpu")


def test_gpu_needs_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="CUDA is not available"):
        nproc("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert nproc("gpu") == determine_local_world_size("gpu") == 8


def test_a_privateuse1_backend_is_counted_by_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 4)
    monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: "npu")
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    assert nproc("npu") == 4


def test_an_unknown_device_word_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match="unknown device 'tpu9'"):
        nproc("tpu9")
    with pytest.raises(ValueError):
        determine_local_world_size("tpu9")

"""The preload server leaves torch._dynamo (most of its start's CPU) out for a script that plainly
does not use it, and keeps it for one that may: an optimizer, DDP, FSDP, distributed
checkpointing, torch.compile, another package or the user's own module."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastictk.supervisor.forkserver import DEFAULT_PRELOAD
from elastictk.supervisor.preloadpick import DYNAMO, preload_for, uses_dynamo

PY = sys.executable
PLAIN = """\
import argparse, os, time
import torch
import torch.distributed as dist
import elastictk.faults
# An optimizer is named in this comment only, and in a string: "torch.optim"
dist.init_process_group("gloo")
t = torch.ones(2)
dist.all_reduce(t)
"""


def pick(tmp: Path, text: str | bytes, name: str = "w.py") -> bool | None:
    p = tmp / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return uses_dynamo([PY, "-u", str(p)])


def test_a_collective_only_script_gets_the_list_without_dynamo(tmp_path: Path) -> None:
    assert pick(tmp_path, PLAIN) is False
    got = preload_for([PY, "-u", str(tmp_path / "w.py")])
    assert DYNAMO not in got and set(got) == set(DEFAULT_PRELOAD) - {DYNAMO}


@pytest.mark.parametrize("line", [
    "opt = torch.optim.SGD([torch.ones(1)], lr=0.1)",
    "from torch.optim import AdamW",
    "from torch import optim",
    "model = torch.compile(torch.nn.Linear(2, 2))",
    "from torch.nn.parallel import DistributedDataParallel as DDP",
    "import torch.distributed.checkpoint as dcp",
    "from torch.distributed.fsdp import fully_shard",
    "def later():\n    import torch._dynamo",
])
def test_a_script_naming_what_imports_dynamo_keeps_it(tmp_path: Path, line: str) -> None:
    assert pick(tmp_path, PLAIN + line + "\n") is True
    assert preload_for([PY, "-u", str(tmp_path / "w.py")]) == DEFAULT_PRELOAD


@pytest.mark.parametrize("line", [
    "import numpy",  # another package may build an optimizer: cannot tell
    "from mytrainer import main",  # the user's own module
    "from . import sibling",
    "def f():\n    import transformers",
])
def test_a_script_importing_code_it_cannot_see_keeps_it(tmp_path: Path, line: str) -> None:
    assert pick(tmp_path, PLAIN + line + "\n") is None
    assert preload_for([PY, "-u", str(tmp_path / "w.py")]) == DEFAULT_PRELOAD


def test_what_is_not_a_readable_script_keeps_the_full_list(tmp_path: Path) -> None:
    (tmp_path / "big.py").write_bytes(b"#" * (1 << 20) + b"\n")
    for argv in ([PY, "-u", "-m", "json.tool"], ["/bin/echo", "hi"], [PY, "-u", str(tmp_path / "missing.py")],
                 [PY, "-u", str(tmp_path / "big.py")], [], [PY, "-O", str(tmp_path / "w.py")]):
        assert uses_dynamo(argv) is None, argv
        assert preload_for(argv) == DEFAULT_PRELOAD
    assert pick(tmp_path, "def (:\n") is None  # does not parse


def test_a_relative_script_is_read_from_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text(PLAIN)
    assert uses_dynamo([PY, "-u", "w.py"], cwd=str(tmp_path)) is False
    assert uses_dynamo([PY, "-u", "w.py"], cwd=str(tmp_path / "elsewhere")) is None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=4000),
                 st.text(max_size=2000),
                 st.integers(1, 400).map(lambda n: "(" * n + ")" * n),  # nested
                 st.integers(1, 3000).map(lambda n: "x = " + "[" * n + "]" * n),
                 st.sampled_from([PLAIN[: i] for i in range(0, len(PLAIN), 7)])))  # truncated
def test_any_bytes_as_a_script_give_an_answer_never_an_error(tmp_path: Path, text: str | bytes) -> None:
    assert pick(tmp_path, text) in (True, False, None)


def test_the_premise_holds_in_this_torch(tmp_path: Path) -> None:
    """What the pick rests on, measured in a fresh interpreter: an optimizer and DDP import
    torch._dynamo, collectives and a model's forward and backward do not. Red when a torch
    upgrade changes either side."""
    code = """\
import json, os, sys, torch, torch.distributed as dist
seen = {}
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
t = torch.ones(2); dist.all_reduce(t)
m = torch.nn.Linear(2, 2); m(torch.ones(1, 2)).sum().backward()
seen["plain"] = "torch._dynamo" in sys.modules
torch.optim.SGD(m.parameters(), lr=0.1)
seen["optimizer"] = "torch._dynamo" in sys.modules
dist.destroy_process_group()
print(json.dumps(seen))
"""
    from elastictk.store import quiet_port

    out = subprocess.run([PY, "-c", code, str(quiet_port())], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"plain": False, "optimizer": True}


WORKER = """\
import json, os, sys
with open(os.path.join(os.environ["OUT"], os.environ["RANK"] + ".json"), "w") as f:
    json.dump({"dynamo": "torch._dynamo" in sys.modules, "torch": "torch" in sys.modules}, f)
"""


@pytest.mark.parametrize("extra,dynamo", [("", False), ("def unused():\n    return torch.optim\n", True)])
def test_elastictk_run_workers_inherit_what_the_pick_chose(tmp_path: Path, extra: str, dynamo: bool) -> None:
    """End to end: the workers fork from the server, so their modules are the server's."""
    script = tmp_path / "w.py"
    script.write_text(WORKER + ("import torch\n" + extra if extra else ""))
    env = {**os.environ, "OUT": str(tmp_path)}
    r = subprocess.run([PY, "-m", "elastictk.run", "--nproc-per-node", "1", str(script)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    seen = json.loads((tmp_path / "0.json").read_text())
    assert seen == {"dynamo": dynamo, "torch": True}, seen

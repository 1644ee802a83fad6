"""Steps without script changes: torch's optimizer step hook, activated in every worker from
``ELASTICTK_WORKER_HOOKS``, feeds the fault injector and the metrics' step counters; a script's
own ``checkpoint(step)``/``step()`` keeps precedence. Real interpreters, real optimizers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from elastictk.faults import Fault, plan_of
from elastictk.faults import env as fenv
from elastictk.metrics import worker as mworker
from elastictk.metrics.steps import WorkerStepsBlock

ROOT = Path(__file__).resolve().parent.parent

OPT_LOOP = """
import sys
{pre}
import torch
model = torch.nn.Linear(2, 1)
opts = [torch.optim.SGD(model.parameters(), lr=0.1) for _ in range({n_opt})]
for i in range({steps}):
    model(torch.ones(1, 2)).sum().backward()
    for o in opts:
        o.step()
    {each}
    print("step", i + 1, flush=True)
"""


SITE = ""  # each test's private sitecustomize directory (fenv.private_site), removed after it


@pytest.fixture(autouse=True)
def _site() -> Iterator[None]:
    global SITE
    with fenv.private_site() as SITE:
        yield


def _env(tmp: Path, plan: object, **extra: str) -> dict[str, str]:
    path = tmp / "plan.json"
    plan.save(path)  # type: ignore[attr-defined]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICTK_")}
    env.update(fenv.worker_env(path, auto="optimizer", log_path=tmp / "faults.jsonl", base_env=env,
                               site=SITE))
    env.update(RANK="0", LOCAL_RANK="0", GROUP_RANK="0", TORCHELASTIC_RESTART_COUNT="0", **extra)
    return env


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def _log(tmp: Path) -> list[dict]:
    p = tmp / "faults.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def test_optimizer_steps_fire_step_faults_in_a_script_with_no_elastictk_calls(tmp_path: Path) -> None:
    plan = plan_of([Fault.of("exit:7", "rank:0", at_step=3)])
    r = _run(OPT_LOOP.format(pre="", n_opt=1, steps=6, each=""), _env(tmp_path, plan))
    assert r.returncode == 7, r.stdout + r.stderr
    assert r.stdout.split() == ["step", "1", "step", "2"]  # the 3rd optimizer.step() ended it
    fired = [d for d in _log(tmp_path) if "fault" in d]
    assert [(d["fault"], d["step"], d["source"]) for d in fired] == [(0, 3, "auto")]


def test_after_a_restore_the_count_goes_on_from_the_restored_step(tmp_path: Path) -> None:
    """The job's own step numbers: a process whose State.restore() brought back step 5 reaches
    step 7 at its 2nd optimizer step (counted from 0, a plan's step 7 would need 7 more)."""
    plan = plan_of([Fault.of("exit:7", "rank:0", at_step=7, attempt=1)])
    pre = ("import elastictk.data.record as record\n"
           "record.resumed(5)  # what State.restore() tells it (the snapshot tier is not here)")
    env = {**_env(tmp_path, plan), "TORCHELASTIC_RESTART_COUNT": "1"}
    r = _run(OPT_LOOP.format(pre=pre, n_opt=1, steps=6, each=""), env)
    assert r.returncode == 7 and r.stdout.split() == ["step", "1"], r.stdout + r.stderr
    fired = [d for d in _log(tmp_path) if "fault" in d]
    assert [(d["fault"], d["step"], d["source"]) for d in fired] == [(0, 7, "auto")]


def test_two_optimizers_of_one_loop_count_one_step(tmp_path: Path) -> None:
    plan = plan_of([Fault.of("exit:7", "rank:0", at_step=4)])
    r = _run(OPT_LOOP.format(pre="", n_opt=2, steps=6, each=""), _env(tmp_path, plan))
    assert r.returncode == 7 and r.stdout.count("step") == 3, r.stdout + r.stderr


def test_a_worker_that_never_imports_torch_does_not_load_it(tmp_path: Path) -> None:
    plan = plan_of([Fault.of("exit:7", "rank:0", at_step=1)])
    r = _run("import sys; print('torch' in sys.modules, 'elastictk.faults.auto' in sys.modules)",
             _env(tmp_path, plan))
    assert r.returncode == 0 and r.stdout.split() == ["False", "True"], r.stdout + r.stderr


def test_the_hooks_are_not_activated_outside_a_worker(tmp_path: Path) -> None:
    """The agent and its fork server inherit PYTHONPATH too: no RANK, no hook."""
    plan = plan_of([Fault.of("exit:7", "rank:0", at_step=1)])
    env = _env(tmp_path, plan)
    del env["RANK"]
    r = _run("import sys; print('elastictk.faults.auto' in sys.modules)", env)
    assert r.stdout.split() == ["False"], r.stdout + r.stderr


def test_checkpoint_takes_precedence_over_the_optimizer_count(tmp_path: Path) -> None:
    """The script says it stays at step 0: the optimizer's 6 steps must not fire step 3."""
    plan = plan_of([Fault.of("exit:7", "rank:0", at_step=3)])
    code = OPT_LOOP.format(pre="import elastictk.faults", n_opt=1, steps=6,
                           each="elastictk.faults.fault_point(0)")
    r = _run(code, _env(tmp_path, plan))
    assert r.returncode == 0 and r.stdout.count("step") == 6, r.stdout + r.stderr
    assert [d["source"] for d in _log(tmp_path) if d.get("progress") == "exit"] == ["checkpoint"]


def _steps_in_block(tmp_path: Path, pre: str, each: str, n_opt: int = 1, steps: int = 5,
                    with_hook: bool = True) -> int:
    with WorkerStepsBlock(1) as block:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICTK_")}
        benv = block.env()
        if not with_hook:
            benv.pop(mworker.ENV_HOOKS)
        env.update(benv, LOCAL_RANK="0", RANK="0", TORCHELASTIC_RESTART_COUNT="0",
                   PYTHONPATH=os.pathsep.join([SITE, str(ROOT)]))
        r = _run(OPT_LOOP.format(pre=pre, n_opt=n_opt, steps=steps, each=each), env)
        assert r.returncode == 0, r.stderr
        return block.snapshot()[0].steps


def test_metrics_count_optimizer_steps_of_any_script(tmp_path: Path) -> None:
    assert _steps_in_block(tmp_path, "", "", n_opt=2) == 5
    assert _steps_in_block(tmp_path, "", "", with_hook=False) == 0  # the hook is what counts


@pytest.mark.parametrize("each", ["etm.step()", "etm.step() if i % 2 else None"])
def test_a_scripts_own_step_calls_take_precedence_and_nothing_counts_twice(tmp_path: Path, each: str) -> None:
    """optimizer.step() runs before the script's step() in each iteration: the automatic count
    of that first step is taken back when the script reports."""
    want = 5 if each == "etm.step()" else 2
    assert _steps_in_block(tmp_path, "import elastictk.metrics as etm", each) == want


def test_the_steps_block_names_its_hook_and_keeps_the_launchers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mworker.ENV_HOOKS, "elastictk.faults.auto")
    with WorkerStepsBlock(1) as block:
        assert block.env()[mworker.ENV_HOOKS] == "elastictk.faults.auto,elastictk.metrics.worker"
    assert fenv.add_hook("elastictk.faults.auto", "elastictk.faults.auto") == "elastictk.faults.auto"


def test_every_reader_spells_the_hooks_variable_the_same() -> None:
    from elastictk.inplace import loop

    site = fenv.SITECUSTOMIZE
    child = (ROOT / "elastictk" / "supervisor" / "child.py").read_text()
    assert fenv.ENV_HOOKS == mworker.ENV_HOOKS == loop.ENV_HOOKS == "ELASTICTK_WORKER_HOOKS"
    assert f'"{fenv.ENV_HOOKS}"' in site and f'"{fenv.ENV_HOOKS}"' in child

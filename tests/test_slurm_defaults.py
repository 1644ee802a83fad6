"""Under srun, elastictk-run takes its rendezvous defaults from Slurm and says so in one line;
flags given win; MIN:MAX in a bigger step leaves spares; malformed variables exit 2 in one
line; a real elastictk-run under a faked one-node Slurm job (localhost as its node) runs."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictk.cli.args import main_for_test
from elastictk.slurm import store_port

ROOT = Path(__file__).resolve().parent.parent


def slurm_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "PET_", "ELASTICTK_"))}
    env.update(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_NNODES="3",
               SLURM_JOB_NODELIST="node[01-03]", SLURMD_NODENAME="node02", SLURM_PROCID="1",
               SLURM_LOCALID="0", PATH="/usr/bin:/bin")
    env.update(extra)
    return {k: v for k, v in env.items() if v != "-"}


@pytest.fixture
def script(tmp_path: Path) -> str:
    p = tmp_path / "w.py"
    p.write_text("")
    return str(p)


def test_defaults_come_from_slurm_and_are_said_once(script: str) -> None:
    code, err, config = main_for_test([script], slurm_env())
    assert code == 0 and config is not None, err
    assert (config.min_nodes, config.max_nodes, config.run_id, config.rdzv_backend) == (3, 3, "4242", "c10d")
    assert (config.rdzv_endpoint.host, config.rdzv_endpoint.port) == ("node01", store_port("4242"))
    assert config.node_id == "node02" and config.rdzv_conf["is_host"] is False
    lines = [ln for ln in err.splitlines() if "under Slurm job 4242" in ln]
    assert len(lines) == 1 and "--nnodes 3" in lines[0] and "node01" in lines[0], err


def test_the_first_host_hosts_the_store(script: str) -> None:
    _, err, config = main_for_test([script], slurm_env(SLURMD_NODENAME="node01"))
    assert config is not None and config.rdzv_conf["is_host"] is True, err


def test_explicit_flags_win(script: str) -> None:
    code, err, config = main_for_test(["--nnodes", "2", "--rdzv-id", "mine", script], slurm_env())
    assert config is not None and (config.max_nodes, config.run_id) == (2, "mine"), err
    assert "--nnodes" not in err.split("under Slurm")[1].split(";")[0].replace("--nnodes 2", "")
    code, err, config = main_for_test(["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1234", script],
                                      slurm_env())
    # another port or store: still the Slurm job, so its node count, id and node id are kept
    assert config is not None and str(config.rdzv_endpoint) == "h:1234", err
    assert (config.min_nodes, config.max_nodes, config.run_id, config.node_id) == (3, 3, "4242", "node02"), err
    (line,) = [ln for ln in err.splitlines() if "under Slurm" in ln]
    assert "--nnodes 3 --rdzv-id 4242 --rdzv-backend c10d --rdzv-endpoint h:1234 as given" in line, line
    code, err, config = main_for_test(["--standalone", script], slurm_env(SLURM_NNODES="1"))
    assert config is not None and config.standalone and "under Slurm" not in err


WHERE_ARGS = {"rdzv_backend": ["--rdzv-backend", "static"], "rdzv_endpoint": ["--rdzv-endpoint", "h:1234"],
              "standalone": ["--standalone"], "master_addr": ["--master-addr", "10.0.0.5"],
              "master_port": ["--master-port", "1234"]}


@pytest.mark.parametrize("dest", sorted(WHERE_ARGS))
def test_each_flag_that_says_where_nodes_meet_keeps_its_value_under_slurm(script: str, dest: str) -> None:
    """Any one flag that says where nodes meet (the five of slurm.defaults.WHERE_FLAGS, named here
    so that the test does not move with the constant) given: the flag's value kept. A standalone
    or static launch is configured as it is outside Slurm, with no "under Slurm" line; a c10d
    endpoint given (another port) keeps the job's node count (test_explicit_flags_win)."""
    argv = WHERE_ARGS[dest] + [script]
    outside = {k: v for k, v in slurm_env().items() if not k.startswith("SLURM")}
    _, err_out, plain = main_for_test(argv, outside)
    code, err, config = main_for_test(argv, slurm_env())
    assert code == 0 and config is not None and plain is not None, err
    if dest == "rdzv_endpoint":
        assert "--rdzv-endpoint h:1234 as given" in err and config.max_nodes == 3, err
        assert str(config.rdzv_endpoint) == str(plain.rdzv_endpoint), err
        return
    assert "under Slurm" not in err, err
    same = ("rdzv_backend", "max_nodes", "min_nodes", "standalone")
    assert [getattr(config, k) for k in same] == [getattr(plain, k) for k in same], err
    if dest != "standalone":  # a standalone store's port is picked at random
        assert str(config.rdzv_endpoint) == str(plain.rdzv_endpoint), err
    if dest in ("master_addr", "master_port"):
        both = main_for_test(["--master-addr", "10.0.0.5", "--master-port", "1234", script], slurm_env())
        assert both[2] is not None and "under Slurm" not in both[1], both[1]
        assert (both[2].rdzv_backend, str(both[2].rdzv_endpoint)) == ("static", "10.0.0.5:1234")


def test_a_pet_variable_counts_as_given(script: str) -> None:
    _, err, config = main_for_test([script], slurm_env(PET_NNODES="1:2"))
    assert config is not None and (config.min_nodes, config.max_nodes) == (1, 2), err
    assert "1 spare node(s)" in err


def test_min_max_inside_a_bigger_step_leaves_spares(script: str) -> None:
    _, err, config = main_for_test(["--nnodes", "2:3", script], slurm_env(SLURM_NNODES="5"))
    assert config is not None and (config.min_nodes, config.max_nodes) == (2, 3)
    assert "2 spare node(s) wait beyond --nnodes 2:3" in err


def test_min_beyond_the_step_is_refused(script: str) -> None:
    code, err, _ = main_for_test(["--nnodes", "4:8", script], slurm_env())
    assert code == 2 and err.count("\n") == 1 and "needs at least 4 nodes" in err, err


def test_outside_srun_nothing_is_taken(script: str) -> None:
    code, err, config = main_for_test([script], slurm_env(SLURM_STEP_ID="-"))
    assert config is not None and config.standalone and config.node_id is None, err
    assert config.preempt_signal is not None  # the job is still Slurm's: its warning signal
    code, err, config = main_for_test([script], slurm_env(SLURM_STEP_ID="-", SLURM_JOB_ID="-"))
    assert config is not None and config.preempt_signal is None


def test_a_second_task_on_a_node_has_its_own_id(script: str) -> None:
    _, err, config = main_for_test([script], slurm_env(SLURM_LOCALID="1", SLURMD_NODENAME="node01"))
    assert config is not None and config.node_id == "node01-task1" and config.rdzv_conf["is_host"] is False


@pytest.mark.parametrize("var,value,says", [
    ("SLURM_JOB_ID", "12x", "SLURM_JOB_ID='12x'"),
    ("SLURM_STEP_ID", "0;rm", "SLURM_STEP_ID"),
    ("SLURM_NNODES", "0", "SLURM_NNODES='0'"),
    ("SLURM_NNODES", "three", "SLURM_NNODES='three'"),
    ("SLURM_JOB_NODELIST", "node[01-03", "SLURM_JOB_NODELIST"),
    ("SLURM_JOB_NODELIST", "-", "SLURM_JOB_NODELIST is not"),
    ("SLURMD_NODENAME", "a b", "SLURMD_NODENAME"),
    ("SLURMD_NODENAME", "node09", "SLURMD_NODENAME 'node09' is not in SLURM_JOB_NODELIST"),
    ("SLURM_LOCALID", "-1", "SLURM_LOCALID"),
])
def test_malformed_slurm_variables_exit_2_in_one_line(script: str, var: str, value: str, says: str) -> None:
    code, err, _ = main_for_test([script], slurm_env(**{var: value}))
    assert code == 2 and err.count("\n") == 1 and says in err and "Traceback" not in err, err


@given(st.dictionaries(st.sampled_from(["SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",
                                        "SLURM_JOB_NODELIST", "SLURMD_NODENAME", "SLURM_LOCALID",
                                        "SLURM_RESTART_COUNT"]),
                       st.text(max_size=30).filter(lambda s: "\x00" not in s)))
@settings(max_examples=200, deadline=None)
def test_any_slurm_environment_runs_or_is_one_line(garbage: dict[str, str]) -> None:
    env = slurm_env(**garbage)
    code, err, config = main_for_test(["/bin/true"], {**env, "PATH": "/usr/bin:/bin"})
    assert code in (0, 2), err
    if code == 2:
        assert err.count("\n") == 1 and "Traceback" not in err, err


def _free_job_id() -> str:
    """A job id whose store port is free here."""
    for n in range(1000):
        job = str(1000 * 7 + n)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", store_port(job)))
            except OSError:
                continue
        return job
    pytest.skip("no free port in the Slurm store range")


def test_elastictk_run_under_a_faked_srun(tmp_path: Path) -> None:
    job = _free_job_id()
    out = tmp_path / "seen.json"
    script = tmp_path / "w.py"
    script.write_text("import json, os\n"
                      f"json.dump({{k: os.environ.get(k) for k in ('TORCHELASTIC_RUN_ID', 'WORLD_SIZE')}}, "
                      f"open({str(out)!r}, 'w'))\n")
    events = tmp_path / "events.jsonl"
    env = slurm_env(SLURM_JOB_ID=job, SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost",
                    SLURMD_NODENAME="localhost", SLURM_PROCID="0", PATH=os.environ["PATH"])
    done = subprocess.run([sys.executable, "-m", "elastictk.run", "--event-log", str(events), str(script)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text()) == {"TORCHELASTIC_RUN_ID": job, "WORLD_SIZE": "1"}
    said = [ln for ln in done.stderr.splitlines() if "under Slurm job" in ln]
    assert len(said) == 1 and f"localhost:{store_port(job)}" in said[0], done.stderr
    ids = {json.loads(ln).get("node_id") for ln in events.read_text().splitlines()}
    assert "localhost" in ids, ids


def test_a_batch_script_without_srun_says_it_runs_one_node(script: str) -> None:
    """elastictk-run in the batch script itself (Slurm job variables, no srun step, or the
    ``batch`` step): one line saying nothing is taken from the job and how to run on its nodes."""
    for step in ("-", "batch"):
        code, err, config = main_for_test([script], slurm_env(SLURM_STEP_ID=step))
        assert code == 0 and config is not None and config.node_id is None, err
        lines = [ln for ln in err.splitlines() if "not started by srun" in ln]
        assert len(lines) == 1 and "train on its 3 nodes" in lines[0] and "srun ... elastictk-run" in lines[0], err
    _, err, _ = main_for_test([script], slurm_env())  # a real srun step: not said
    assert "not started by srun" not in err


def test_a_node_not_in_the_node_list_says_why_instead_of_waiting(script: str) -> None:
    """SLURMD_NODENAME not among the listed hosts: no node could tell it hosts the store (all
    would wait out the join timeout); exit 2, one line naming both and the fix."""
    code, err, _ = main_for_test([script], slurm_env(SLURMD_NODENAME="node02.cluster"))
    assert code == 2 and err.count("\n") == 1, err
    assert "SLURMD_NODENAME 'node02.cluster' is not in SLURM_JOB_NODELIST (node01, node02, node03)" in err
    assert "--rdzv-endpoint HOST:PORT" in err
    # the endpoint given: nothing depends on the name, the job goes on
    code, err, config = main_for_test(["--rdzv-endpoint", "node01:29999", script],
                                      slurm_env(SLURMD_NODENAME="node02.cluster"))
    assert code == 0 and config is not None and config.max_nodes == 3, err
    # only the endpoint given: the job's c10d store at another place, not torchrun's static default
    assert config.rdzv_backend == "c10d" and "--rdzv-backend c10d --rdzv-endpoint node01:29999 as given" in err, err

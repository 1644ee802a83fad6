"""A launcher that names a steps block in the workers' environment but does not give it to an
agent that counts steps (its progress watchdog is on) is warned: its workers count into the
agent's own block instead. Without a foreign block, no warning."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import os, sys, tempfile
    from elastictk.agent import AgentConfig, ElasticAgent
    from elastictk.metrics.worker import ENV_PATH
    from elastictk.rendezvous import RendezvousConfig
    from elastictk.store import TCPStore
    from elastictk.supervisor import WorkerSpec

    def work() -> str:
        return os.environ.get(ENV_PATH, "")

    if __name__ == "__main__":
        env = {ENV_PATH: "/proc/self/fd/999"} if sys.argv[1] == "foreign" else {}
        store = TCPStore.serve("127.0.0.1", 0)
        with tempfile.TemporaryDirectory() as logs:
            agent = ElasticAgent(AgentConfig(
                spec=WorkerSpec(entrypoint=work, local_world_size=1, start_method="spawn", env=env),
                rdzv=RendezvousConfig("warn-job", min_nodes=1, max_nodes=1), max_restarts=0,
                log_dir=logs, progress_timeout=60), store, store_endpoint=f"127.0.0.1:{store.port}")
            result = agent.run()
        store.close()
        print("exit", result.exit_code, "block", result.return_values[0] != "/proc/self/fd/999")
""")


def _run(tmp_path: Path, which: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "launcher.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICTK_", "PET_"))}
    return subprocess.run([sys.executable, "launcher.py", which], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)


def test_a_steps_block_the_agent_was_not_given_is_warned_about(tmp_path: Path) -> None:
    out = _run(tmp_path, "foreign")
    assert out.returncode == 0, out.stderr[-2000:]
    # the workers count into the agent's own block, not the one the launcher named
    assert "exit 0 block True" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "names a steps block" in out.stderr and "AgentConfig.steps" in out.stderr, out.stderr[-2000:]


def test_no_warning_without_a_foreign_steps_block(tmp_path: Path) -> None:
    out = _run(tmp_path, "none")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "exit 0" in out.stdout, out.stdout
    assert "names a steps block" not in out.stderr, out.stderr[-2000:]

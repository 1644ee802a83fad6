"""One ``EventKind`` for every emitter and sink: what the agent emits is a member, every member
is emitted somewhere, and AgentMetrics handles or deliberately ignores each one."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from elastictk.metrics.agent_metrics import IGNORED, KNOWN_KINDS, AgentMetrics
from elastictk.metrics.events import read_events
from elastictk.metrics.kinds import EventKind

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "elastictk"
WORKER = str(ROOT / "tests" / "helpers" / "agent_worker.py")


# -- the enum itself ------------------------------------------------------------------------------
def test_a_member_reads_as_its_plain_value_everywhere_a_string_goes() -> None:
    k = EventKind.WORKER_FAILED
    assert str(k) == f"{k}" == format(k) == "%s" % k == "worker_failed"
    assert json.dumps({"kind": k}) == '{"kind": "worker_failed"}'
    assert k == "worker_failed" and {"worker_failed": 1}[k] == 1  # chaos compares with strings
    assert EventKind("worker_failed") is k


def test_an_unknown_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="nope"):
        EventKind("nope")

    seen: list[EventKind] = []

    def strict_sink(kind: str, **fields: object) -> None:  # what the test below holds emitters to
        seen.append(EventKind(kind))

    strict_sink(EventKind.RESTART, restart_count=1)
    with pytest.raises(ValueError):
        strict_sink("restart_all_the_things", restart_count=1)
    assert seen == [EventKind.RESTART]


def test_values_are_unique_snake_case_and_each_member_is_commented() -> None:
    values = [k.value for k in EventKind]
    assert len(set(values)) == len(values)
    assert all(re.fullmatch(r"[a-z]+(_[a-z]+)*", v) for v in values)
    source = (PACKAGE / "metrics" / "kinds.py").read_text()
    for k in EventKind:
        line = next(ln for ln in source.splitlines() if ln.strip().startswith(f"{k.name} = "))
        assert "#" in line and len(line.split("#", 1)[1].strip()) > 10, f"{k.name} has no comment"


def test_mypy_rejects_a_plain_string_where_an_event_kind_goes(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    snippet = tmp_path / "emit_a_string.py"
    snippet.write_text("from elastictk.metrics.kinds import Emit, EventKind\n\n\n"
                       "def report(emit: Emit) -> None:\n"
                       "    emit(EventKind.RESTART, restart_count=1)\n"
                       "    emit(\"restart\", restart_count=1)\n")
    # elastictk's TYPE_CHECKING imports lead to torch: its stubs are skipped (Any), which leaves
    # elastictk's own types checked and costs 1.5 s of CPU instead of 18.
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\nfollow_imports = silent\nignore_missing_imports = true\n"
                      "[mypy-torch,torch.*,numpy,numpy.*,sympy,sympy.*]\nfollow_imports = skip\n")
    p = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir",
                        str(tmp_path / "cache"), str(snippet)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    errors = [ln for ln in p.stdout.splitlines() if ": error:" in ln]
    assert len(errors) == 1 and f"{snippet.name}:6:" in errors[0], p.stdout
    assert '"str"; expected "EventKind"' in errors[0]


# -- every member is emitted by some code, and no emitter uses a loose string ---------------------
def _emitting_sources() -> dict[Path, str]:
    """The package's source, less the enum and the sinks (which name every member)."""
    return {p: p.read_text() for p in PACKAGE.rglob("*.py")
            if "metrics" not in p.relative_to(PACKAGE).parts}


def never_emitted(kinds: list[EventKind], sources: dict[Path, str]) -> list[EventKind]:
    return [k for k in kinds if not any(re.search(rf"\bEventKind\.{k.name}\b", s) for s in sources.values())]


def test_every_member_is_emitted_by_some_code() -> None:
    assert never_emitted(list(EventKind), _emitting_sources()) == []


def test_the_static_check_finds_a_member_nothing_emits() -> None:
    fake = {Path("a.py"): "self._emit(EventKind.RESTART, restart_count=1)\n"
                          "emit(EventKind.RESTART_PENDING)  # another name, not RESTART\n"}
    assert never_emitted([EventKind.RESTART, EventKind.JOB_FAILED], fake) == [EventKind.JOB_FAILED]


def test_no_emitter_passes_a_string_literal() -> None:
    loose = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p, s in _emitting_sources().items()
             for m in re.finditer(r"\bemit\(\s*[\"'][^\"']*[\"']", s)]
    assert loose == []


# -- AgentMetrics: a dict over EventKind -----------------------------------------------------------
def test_agent_metrics_handles_or_deliberately_ignores_every_member() -> None:
    m = AgentMetrics(CollectorRegistry(), job="j", node="n0")
    table = m._handlers
    assert set(table) == set(EventKind), "every member, and only members, in the table"
    assert {k for k, h in table.items() if h is None} == IGNORED
    assert all(callable(h) for k, h in table.items() if k not in IGNORED)
    assert set(KNOWN_KINDS) == {k.value for k in EventKind}  # no label for a kind nothing emits


def test_agent_metrics_counts_every_member_under_its_value() -> None:
    reg = CollectorRegistry()
    m = AgentMetrics(reg, job="j", node="n0")
    for k in EventKind:
        m(k)  # no fields at all: handlers must cope, and never raise
    for k in EventKind:
        assert reg.get_sample_value("elastictk_events_total",
                                    {"run_id": "j", "node": "n0", "role": "default", "kind": k.value}) == 1, k


# -- a real small job -------------------------------------------------------------------------------
DRIVER = """
import json, sys
from elastictk.cli import parse_or_exit
from elastictk.agent import build_agent
from elastictk.metrics import Telemetry

config = parse_or_exit(sys.argv[1:])
tel = Telemetry.from_launch(config, node="node-0")
agent, handle = build_agent(config, tel)
seen = []
sink = agent.config.on_event

def on_event(kind, **fields):
    seen.append([type(kind).__name__, str(kind)])
    sink(kind, **fields)

agent.config.on_event = on_event
try:
    result = agent.run()
finally:
    handle.close()
    tel.close()
print(json.dumps({"seen": seen, "state": str(result.state), "code": result.exit_code}))
"""


@pytest.mark.parametrize("restarts, state, must", [
    ("1", "succeeded", {"rendezvous_started", "round_joined", "workers_started", "worker_failed",
                        "workers_stopped", "restart", "job_finished"}),
    ("0", "failed", {"rendezvous_started", "round_joined", "workers_started", "worker_failed",
                     "workers_stopped", "job_failed"}),
])
def test_every_kind_a_real_job_emits_is_a_member(tmp_path: Path, restarts: str, state: str,
                                                 must: set[str]) -> None:
    log = tmp_path / "events.jsonl"
    p = subprocess.run(
        [sys.executable, "-c", DRIVER, "--standalone", "--nproc-per-node", "2", "--start-method", "spawn",
         "--max-restarts", restarts, "--log-dir", str(tmp_path / "logs"), "--event-log", str(log),
         WORKER, str(tmp_path), "--fail", "0:1:exit:3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert (out["state"], out["code"]) == (state, 0 if state == "succeeded" else 1)
    seen = out["seen"]
    assert {t for t, _ in seen} == {"EventKind"}, "the agent emits members, never plain strings"
    kinds = [v for _, v in seen]
    assert must <= set(kinds), kinds
    written = [e.kind for e in read_events(log)]
    assert written == kinds, "the event log holds each member's plain value, in order"
    assert all(EventKind(k) for k in written)


# -- outcomes, decisions and recovery modes -----------------------------------------------------------
def test_a_decision_keeps_its_wire_format_and_reads_back_as_the_enum() -> None:
    from elastictk.agent import DecisionAction
    from elastictk.agent.coordination import Decision

    d = Decision(DecisionAction.RESTART, 2, "boom", 0.5)
    assert d.to_json() == b'{"action": "restart", "restart_count": 2, "reason": "boom", "delay_s": 0.5}'
    back = Decision.from_json(d.to_json())
    assert back == d and back.action is DecisionAction.RESTART
    assert Decision("give_up", 1, "x").action is DecisionAction.GIVE_UP  # the value is accepted
    with pytest.raises(ValueError):
        Decision.from_json(b'{"action": "reboot", "restart_count": 1, "reason": "x"}')


def test_an_unknown_action_in_the_store_is_a_malformed_decision_not_a_crash() -> None:
    from elastictk.agent.coordination import RoundCoordinator
    from elastictk.rendezvous.errors import RendezvousStateError
    from elastictk.store import TCPStore

    server = TCPStore.serve(timeout=20)
    try:
        coord = RoundCoordinator(server, server.clone(), "n0", on_failure=lambda: None)
        try:
            server.set("decision", b'{"action": "reboot", "restart_count": 1, "reason": "x"}')
            with pytest.raises(RendezvousStateError, match="malformed decision"):
                coord.await_decision(1.0)
        finally:
            coord.stop(wait=True)
    finally:
        server.close()


def test_recovery_and_result_state_compare_as_their_values() -> None:
    from elastictk.agent import AgentConfig, Outcome, Recovery, ResultState
    from elastictk.rendezvous import RendezvousConfig
    from elastictk.supervisor.spec import WorkerSpec

    spec, rdzv = WorkerSpec(entrypoint=["true"], local_world_size=1), RendezvousConfig(job_id="j")
    assert AgentConfig(spec, rdzv, recovery="in-place").recovery is Recovery.IN_PLACE
    assert AgentConfig(spec, rdzv).recovery is Recovery.RESTART_ALL
    with pytest.raises(ValueError):
        AgentConfig(spec, rdzv, recovery="never")
    assert ResultState.FINISHED_ELSEWHERE == "finished-elsewhere" and f"{ResultState.SIGNALLED}" == "signalled"
    assert len(Outcome) == 8 and not isinstance(Outcome.SUCCEEDED, int)

"""The report of ``python -m bench rendezvous --scale``: its markdown, and the notes that say how
to read it. A pure function of the result (``bench/_rdzv_scale.py`` measures it)."""
from __future__ import annotations

import json
from typing import Any

from . import _rdzv_scale_beside as beside
from . import _rdzv_scale_c10d as c10d
from ._rdzv_scale_join import markdown_rows
from .common import fmt

STORES = {"tcp": "TCPStore", "etcd": "etcd"}  # elastictk's rendezvous over each
BACKENDS = {**STORES, "c10d": c10d.LABEL}  # and torch's own, beside it


def _f(x: float | None) -> str:
    return "—" if x is None else fmt(x)


def markdown(result: dict[str, Any], intro: str = "") -> str:
    """The kept report; ``intro`` is what the benchmark measures (bench/_rdzv_scale.py's docstring),
    passed in so this module needs nothing from the runner that imports it."""
    m = result["machine"]
    lines = [f"# {result.get('title', 'Rendezvous at scale')}", "", intro, "",
             "## Results", "",
             "| store | nodes | round formed (s) | first rank (s) | server CPU to form (s) | nodes' CPU to form (s) "
             "| steady store calls/s | calls/s per node | server CPU (% of a core) | nodes' CPU (cores) "
             "| lost node noticed (s) | every survivor told (s) | re-formed without it (s) |",
             "|" + "---|" * 13]
    for c in result["cases"]:
        if "error" in c:
            lines.append(f"| {BACKENDS[c['backend']]} | {c['nodes']:,} | failed: {c['error']} |" + " |" * 10)
            continue
        if c.get("form_note"):  # torch's c10d round, not formed within its cap
            lines.append(f"| {BACKENDS[c['backend']]} | {c['nodes']:,} | {c['form_note']} | — "
                         f"| {_f(c.get('form_server_cpu_s'))} | {_f(c.get('form_nodes_cpu_s'))} |" + " — |" * 7)
            continue
        g = c.get
        calls = g("steady_calls_per_s")
        cpu = g("steady_server_cpu")
        lines.append(
            f"| {BACKENDS[c['backend']]} | {c['nodes']:,} | {_f(g('form_s'))} | {_f(g('form_first_rank_s'))} "
            f"| {_f(g('form_server_cpu_s'))} | {_f(g('form_nodes_cpu_s'))} | {_f(calls)} "
            f"| {_f(None if calls is None else calls / c['nodes'])} | {_f(None if cpu is None else 100 * cpu)} "
            f"| {_f(g('steady_bench_cpu'))} | {_f(g('lost_noticed_s'))} | {_f(g('lost_all_told_s'))} "
            f"| {_f(g('reformed_s'))} |")
    for c in result["cases"]:
        for note in (c.get("phases"), c.get("reform_note")):
            if note:
                lines.append(f"\n{BACKENDS[c['backend']]} with {c['nodes']:,} nodes: {note}.")
    lines += ["", "## Per join (each node's own connection: calls, keys and values in and out)", ""]
    lines += markdown_rows(result["cases"], BACKENDS)
    lines += beside.unfinished_rows(result["cases"])
    if any(c["backend"] == "c10d" for c in result["cases"]):
        lines += [""] + beside.markdown(result["cases"])
    if result.get("refusal"):
        lines += ["", f"Times {result['refusal']}."]
    lines += ["", "## Verdicts", ""]
    lines += [f"- **{v['verdict']}** {v['target']}: {v['measured']}" for v in result["verdicts"]]
    lines += ["", "## What each node sends per second (steady state, largest size per store)", ""]
    for backend, label in STORES.items():
        done = [c for c in result["cases"] if c["backend"] == backend and "steady_calls_per_node_s" in c]
        if done:
            top = done[-1]
            per = ", ".join(f"{op} {fmt(v)}" for op, v in top["steady_calls_per_node_s"].items())
            lines.append(f"- {label}, {top['nodes']:,} nodes: {per}")
    lines += ["", "## Notes", ""] + [f"- {note}" for note in result["notes"]]
    lines += ["", "## Machine", "",
              f"{m['cpu_model']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}, "
              f"{m['platform']}; load average (1/5/15 min) {m.get('loadavg_at_start')} at the start and "
              f"{m.get('loadavg_at_end')} at the end. Finished at {result['when']}.",
              "", "## Parameters", "", f"`{json.dumps(result['params'])}`"]
    return "\n".join(lines) + "\n"


NOTES = [
    "a simulated node is a set of threads (bench/_rdzv_scale_nodes.py), up to 16 nodes to a "
    "forked worker process (bench/_rdzv_scale_fleet.py): every node opens its own four store "
    "connections (its own, its heartbeat's, its membership watch's, its failure watch's) and "
    "sends what a real agent sends, from the same code, so the server sees the traffic of N "
    "agents; what the nodes share is this machine's cores, so their own work (JSON, HMACs) "
    "is done on the same few cores where real nodes each have a host: the columns 'nodes' "
    "CPU' say when the clients, not the server, were the limit",
    "calls are elastictk Store calls (set, get, add, compare_set, multi_get, wait): on "
    "TCPStore a get is two requests on the wire (a check, then an atomic read), a set two "
    "(the write, then a check that makes it visible); a wait that times out is one call that "
    "held the server's waiter list for its length",
    "steady state is what an agent runs in a round: a heartbeat (add, every heartbeat "
    "interval; on etcd a keepalive of the node's lease every third of the heartbeat timeout, "
    "its peers holding a watch stream on its key under that lease), the membership watch (a wait on the next round's arrivals, a get of it and a "
    "multi_get of two ring successors' heartbeats, every interval), the failure watch (a "
    "get and a wait on the round's 'failed' key, every second) and the straggler records of "
    "--straggler-action report (one set per node per 5 s window; the leader reads every "
    "member's record, one get each: O(nodes) for the job, O(1) per node on average)",
    c10d.NOTE,
    "re-forming: the nodes run as --nnodes N with a 30 s last call; for the re-form each "
    "survivor joins with MIN N-1 and no last call, so the new round closes as soon as the "
    "last live member of the old one is back, and the time measured is the protocol's",
]

"""A rendezvous join on a thread of its own, and the end of a test that started some.

Tests of watches and waiting nodes start a node's ``next_round()`` beside the watch they judge
and must stop it however the test ends: the watch first (its thread joined), then every
handler interrupted (a join still waiting ends within half a second), the join threads
joined, the handlers closed. One copy of that, so no test leaves a join thread waiting out its
timeout on a closed store.
"""
from __future__ import annotations

import threading
from typing import Iterable

from elastictk.rendezvous import MembershipWatch, RendezvousHandler, RendezvousInterrupted


def join_in_background(h: RendezvousHandler, out: dict[str, object] | None = None) -> threading.Thread:
    """``h.next_round()`` on a daemon thread, started. With ``out``, its round or exception (an
    interrupt by :func:`end_joins` included) goes to ``out[h.node_id]``; without, only the
    interrupt at the test's end is quiet, and any other exception is the thread's own."""
    def run() -> None:
        try:
            got: object = h.next_round()
        except RendezvousInterrupted as e:
            got = e
        except Exception as e:  # noqa: BLE001 - judged by the test that asked for ``out``
            if out is None:
                raise
            got = e
        if out is not None:
            out[h.node_id] = got

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def end_joins(handlers: Iterable[RendezvousHandler], threads: Iterable[threading.Thread | None],
              watch: MembershipWatch | None = None) -> None:
    """Stop ``watch``, interrupt every handler, join the threads, close the handlers."""
    hs = list(handlers)
    if watch is not None:
        watch.stop(wait=True)
    for h in hs:
        h.interrupt()
    for t in threads:
        if t is not None:
            t.join(30)
    for h in hs:
        h.close()

"""Starting one worker by the spec's start method, and the helpers each method needs.

Apart from ``group.py`` because it is everything that differs between the start methods
(``subprocess``, ``multiprocessing``'s ``spawn``/``fork``/``forkserver``, ``preload``); the group
only decides *when* a rank starts (with which logs and environment) and watches what comes of it.

``WorkerStarter`` holds the helpers a start method needs for the group's life: the preload fork
server (started and owned here unless one was passed in, which the caller then owns) with its
hot standby, and a hold on torch's multiprocessing forkserver.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Optional, Sequence

from .forkserver import DEFAULT_PRELOAD, ForkServerError, PreloadServer
from .preloadpick import preload_for
from .logs import RankLogs
from .process import (
    WorkerProcess, acquire_mp_forkserver, release_mp_forkserver, start_multiprocessing,
    start_preloaded, start_subprocess,
)
from .spec import WorkerSpec, parse_python_argv


class WorkerStarter:
    """Starts workers by the spec's start method and holds that method's helpers."""

    def __init__(self, spec: WorkerSpec, preload_server: Optional[PreloadServer] = None,
                 preload_modules: Optional[Sequence[str]] = None) -> None:
        self.spec = spec
        self.server = preload_server
        self._own_server = preload_server is None
        self._preload_modules = preload_modules
        self._mp_forkserver = False
        self.standby = False  # the next start(standby=True) promotes the server's standby

    def prepare(self) -> None:
        """Start the preload server's import now (it overlaps rendezvous); idempotent."""
        if self.spec.start_method == "preload":
            self.preload_server().start()

    def preload_server(self) -> PreloadServer:
        if self.server is None:
            modules = self._preload_modules
            if modules is None:
                modules = DEFAULT_PRELOAD if self.spec.is_function else preload_for(self.spec.argv(0))
            self.server = PreloadServer(preload=modules)
        return self.server

    def keep_standby(self) -> bool:
        """Have the preload server keep one warmed standby (see ``WorkerGroup.keep_standby``);
        False where workers do not fork from a preload server."""
        if self.spec.start_method != "preload":
            return False
        recipe: dict[str, object] = {"cwd": os.getcwd()}
        target = None if self.spec.is_function else parse_python_argv(self.spec.argv(0))
        if target is not None:  # what the standby may import ahead (forkwarm.prewarm)
            recipe.update(kind=target.kind, target=target.target)
        self.preload_server().keep_standby(recipe)
        self.standby = True
        return True

    def start(self, local_rank: int, env: dict[str, str], logs: RankLogs,
              private_fds: Callable[[], list[int]], standby: bool = False) -> WorkerProcess:
        """Start worker ``local_rank``; ``private_fds()`` are the agent's fds a fork-started
        worker closes first."""
        spec = self.spec
        method = spec.start_method
        if method == "subprocess":
            return start_subprocess(local_rank, spec.argv(local_rank), env, logs, spec.death_signal)
        if method == "preload":
            server = self.preload_server()
            if spec.is_function:
                return start_preloaded(local_rank, server, env, logs, spec.death_signal,
                                       fn=spec.entrypoint,  # type: ignore[arg-type]
                                       args=spec.rank_args(local_rank), sys_path=sys.path,
                                       standby=standby)
            target = parse_python_argv(spec.argv(local_rank))
            return start_preloaded(local_rank, server, env, logs, spec.death_signal, target=target,
                                   standby=standby)
        import torch.multiprocessing as tmp  # lazily: only function workers need torch here

        if method == "forkserver" and not self._mp_forkserver:
            acquire_mp_forkserver()
            self._mp_forkserver = True
        return start_multiprocessing(
            local_rank, tmp.get_context(method), spec.entrypoint,  # type: ignore[arg-type]
            spec.rank_args(local_rank), env, logs, spec.death_signal, private_fds())

    def fds(self) -> list[int]:
        """The helpers' fds in the agent (the preload server's control socket)."""
        if self.server is not None and self.server.fileno() is not None:
            return [self.server.fileno()]  # type: ignore[list-item]
        return []

    def close(self) -> None:
        """Close an owned server; a shared one only loses this group's standby."""
        if self.server is not None and self._own_server:
            self.server.close()
        elif self.server is not None and self.standby:
            try:  # a shared server: this group's standby goes with the group
                self.server.drop_standby()
            except ForkServerError:
                pass  # the server is gone, and its standby with it
        if self._mp_forkserver:
            release_mp_forkserver()
            self._mp_forkserver = False

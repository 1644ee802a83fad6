"""How the agents of one rendezvous round agree on the in-place store and first generation.

The in-place store outlives rounds: when nodes join or leave, the workers that keep running
are still connected to it, so the agent that hosts it stays the host for as long as it is a
member, and publishes each round's first generation. One record per round (``Setup``, in the
round's store) tells every other agent where the store is, under which prefix, from which
generation, and whether the running workers are kept.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from typing import Optional, Sequence

from .._safejson import Unreadable, loads_object
from ..inplace.protocol import Generation, Sealer, gen_key, newest_sealed
from ..rendezvous import RoundInfo
from ..rendezvous.auth import Signer
from ..rendezvous.sealed import Records, derive_key
from ..store import Store, StoreError, StoreTimeout, TCPStore

STORE_KEY = "inplace_setup"  # in the rendezvous round's store: the round's Setup (JSON)
HOST_KEY = "inplace/host"  # in the job's store: the node whose agent hosts the in-place store


def inplace_key(signer: Signer) -> str | None:
    """The run's in-place key (token jobs): what seals the in-place store's records and all
    the workers get of the token (``ENV_KEY``); None without a token."""
    return derive_key(signer, "inplace")


def started_key(node_id: str) -> str:
    """In the round's store: a node that joined in place has started its workers."""
    return f"inplace_started/{node_id}"


@dataclass(frozen=True)
class Setup:
    """What every agent of a round uses in in-place mode; one agent writes it (see ``agree``).

    ``keep``: the previous round's workers keep running and re-form in generation ``gen`` with
    the nodes that joined or without those that left; otherwise ``gen`` is 0 under a fresh
    ``prefix`` and every agent starts its workers anew.
    """

    endpoint: str
    prefix: str
    gen: int
    keep: bool

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Setup":
        try:
            return cls.from_record(loads_object(raw))
        except Unreadable:
            raise StoreError(f"in-place setup record {STORE_KEY!r}: expected JSON with endpoint, "
                             f"prefix, gen and keep, got {raw[:80]!r}") from None

    @classmethod
    def from_record(cls, d: object) -> "Setup":
        try:
            if not isinstance(d, dict):
                raise TypeError("not an object")
            gen = d["gen"]
            if isinstance(gen, bool) or not isinstance(gen, int) or gen < 0:
                raise ValueError("gen")
            return cls(str(d["endpoint"])[:300], str(d["prefix"])[:300], gen, bool(d["keep"]))
        except (ValueError, KeyError, TypeError):
            raise StoreError(f"in-place setup record {STORE_KEY!r}: expected JSON with endpoint, "
                             f"prefix, gen and keep, got {str(d)[:80]!r}") from None


class InPlaceHost:
    """The in-place store an agent hosts, and the per-round agreement on how to use it.

    The store outlives rounds: when nodes join or leave, the workers that keep running are
    still connected to it, so the agent hosting it stays the host (its node id is in the job's
    store under ``HOST_KEY``) for as long as it is a member. Only when the host is gone does the
    group rank 0 agent start a fresh one, and then no worker can be kept.
    """

    def __init__(self, addr: str, node_id: str) -> None:
        self.addr = addr
        self.node_id = node_id
        self._server: Optional[TCPStore] = None
        self._prefix: Optional[str] = None  # the generations this agent hosts now

    def agree(self, job: Store | Records, info: RoundInfo, *, keep: bool, fresh_prefix: str,
              first: Generation, joining: Sequence[str], timeout: float,
              start_timeout: float) -> Setup:
        """The round's setup: written by the host (or, with the host gone, by group rank 0),
        read by everyone else. ``keep``: this agent's workers are still running and re-forming
        them in place is possible; the host's own ``keep`` decides for the round. ``first`` is
        the generation to publish (its number is filled in here).

        When nodes join in place, the generation is published only once their agents have
        started their workers (``started``; at most ``timeout``): the kept workers train on
        meanwhile instead of waiting, at the new generation, for a fork server to start
        (at most ``start_timeout``).

        ``job`` is the job's sealed records (a bare store: no token): the host and setup
        records are sealed, and one that does not verify is absent (never followed)."""
        records = job if isinstance(job, Records) else Records(job, "", Signer(None))
        round_records = records.view(info.store, info.store_prefix)
        data = records.read(HOST_KEY)
        host = str(data.get("node_id")) if data is not None else None
        members = {m.node_id for m in info.members}
        if host == self.node_id and self._prefix is not None:
            setup = self._setup(records, keep)
        elif (host is None or host not in members) and info.rank == 0:
            records.write(HOST_KEY, {"node_id": self.node_id})
            setup = self._setup(records, False)
        else:
            got = round_records.wait(STORE_KEY, timeout)
            if got is None:
                raise StoreTimeout(f"no in-place setup in {round_records.name(STORE_KEY)!r} within {timeout:g}s")
            return Setup.from_record(got)
        self._prefix = setup.prefix if setup.keep else fresh_prefix
        setup = replace(setup, prefix=self._prefix)
        round_records.write(STORE_KEY, asdict(setup))
        if setup.keep and joining:
            # Each joiner's sealed mark (a stranger's bytes are waited past); publish anyway
            # at the deadline: the late workers join the formed generation's group.
            deadline = time.monotonic() + start_timeout
            for n in joining:
                round_records.wait(started_key(n), deadline - time.monotonic())
        server = self._server
        assert server is not None
        # Once: the workers' rank 0 may have written "finished" here as the job ended. Sealed
        # with a token; bytes there that do not verify are replaced.
        sealer = self._sealer(records)
        key = gen_key(setup.gen)
        sealer.claim(key, replace(first, gen=setup.gen).to_json(),
                     lambda old, new: server.compare_set(f"{sealer.prefix}/{key}", old, new))
        return setup

    def _sealer(self, records: Records) -> Sealer:
        assert self._prefix is not None
        return Sealer(inplace_key(records.signer), self._prefix)

    def _setup(self, records: Records, keep: bool) -> Setup:
        if self._server is None:
            self._server = TCPStore.serve(self.addr, 0)
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        endpoint = f"{host}:{self._server.port}"
        if keep and self._prefix is not None:
            # The generation after the newest the kept workers could be in (records are
            # numbered without gaps from 0; see inplace.protocol.newest).
            server, sealer = self._server, self._sealer(records)
            gen = newest_sealed(sealer, lambda key: server.try_get(sealer.name(key)), 0) + 1
            return Setup(endpoint, self._prefix, gen, True)
        return Setup(endpoint, "", 0, False)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

"""What the agents of one job agree on through the store, beyond membership.

- **Failure propagation.** The first agent whose worker fails writes the round's ``failed``
  key (compare-and-set, so exactly one wins); every other agent is blocked on that key in a
  thread and stops its workers the moment it appears, instead of leaving them hung in a
  collective until a backend timeout.
- **A job-wide restart budget.** Only the winner of ``failed`` runs the restart policy, on the
  policy state kept in the job's store, and publishes the decision; so ``--max-restarts``
  means the same for the whole job however many agents there are, and every node sees the
  same ``TORCHELASTIC_RESTART_COUNT``.
- **Only the job's nodes count.** With a job token (``--rdzv-token``) the failure note, the
  policy state and the decision are signed like the rendezvous records: a stranger's
  ``failed`` is ignored, a forged budget or decision is rejected naming its key, so nobody
  without the token can spend the budget or change the restart count.
- **An exit barrier.** A node whose workers finished waits for the others, so a fast node
  does not tear the store down under slow peers.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..rendezvous.auth import Signer
from ..rendezvous.errors import RendezvousStateError
from ..store import Store, StoreClosed, StoreError, StoreTimeout
from .policy import Failure, GiveUp, PolicyState, Restart, RestartPolicy

POLICY_KEY = "policy"
_OPEN = Signer(None)
log = logging.getLogger("elastictk.agent")


def seal(signer: Signer, name: str, body: dict[str, Any]) -> bytes:
    """``body`` as JSON, signed for store key ``name`` when the job has a token."""
    return json.dumps(signer.seal(name, body), sort_keys=True).encode()


def unseal(signer: Signer, name: str, raw: bytes) -> dict[str, Any]:
    """The JSON object at ``name``, its MAC checked; errors are one line naming the key."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        data = None
    if not isinstance(data, dict):
        raise RendezvousStateError(f"store key {name!r} holds {len(raw)} bytes that are not a JSON "
                                   "object; use a fresh --rdzv-id or clear the store")
    body = signer.check(name, data)
    return {k: v for k, v in body.items() if k != "mac"}


@dataclass(frozen=True)
class FailureNote:
    """Who failed first in a round, in words every node can print."""

    node_id: str
    headline: str

    def to_json(self) -> bytes:
        return json.dumps({"node_id": self.node_id, "headline": self.headline}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "FailureNote":
        try:
            data = json.loads(raw)
            return cls(str(data["node_id"]), str(data["headline"]))
        except (ValueError, KeyError, TypeError):
            return cls("?", f"unreadable failure note ({len(raw)} bytes)")


@dataclass(frozen=True)
class Decision:
    """What the job does after a round's failure; the same on every node."""

    action: str  # "restart" | "give_up"
    restart_count: int
    reason: str
    delay_s: float = 0.0

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Decision":
        data = json.loads(raw)
        return cls(str(data["action"]), int(data["restart_count"]), str(data["reason"]), float(data.get("delay_s", 0.0)))


def restart_count(job: Store, signer: Signer = _OPEN, prefix: str = "") -> int:
    """Failures the job has restarted from so far (what workers see as TORCHELASTIC_RESTART_COUNT)."""
    raw = job.try_get(POLICY_KEY)
    return 0 if raw is None else _policy_state(raw, signer, f"{prefix}/{POLICY_KEY}").restart_count


def _policy_state(raw: bytes, signer: Signer, name: str) -> PolicyState:
    try:
        return PolicyState.from_json(unseal(signer, name, raw))
    except ValueError as e:
        raise RendezvousStateError(f"store key {name!r}: {e}; use a fresh --rdzv-id") from None


class RoundCoordinator:
    """One agent's view of one round's shared keys, with a thread that watches ``failed``."""

    def __init__(self, job: Store, round_store: Store, node_id: str, on_failure: Callable[[], None],
                 signer: Signer = _OPEN, where: tuple[str, str] = ("", "")) -> None:
        self.job = job
        self.round = round_store
        self.signer = signer
        self._job_prefix, self._round_prefix = where  # full key names, for MACs and errors
        self.node_id = node_id
        self.failed = threading.Event()
        self._on_failure = on_failure
        self._stop = threading.Event()
        self._watch_store = round_store.clone()
        self._thread = threading.Thread(target=self._watch, name="elastictk-failure-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._watch_store.wait(["failed"], 1.0)
                except StoreTimeout:
                    continue
                except StoreClosed:
                    return
                except StoreError:
                    # Briefly unavailable (an etcd election): keep watching; a store that is
                    # gone for good is reported by the heartbeat and the membership watch.
                    self._stop.wait(0.5)
                    continue
                if self._watch_store.try_get("failed") is None:
                    # c10d's wait can return without the key when an earlier round's watch
                    # (stopped, not joined) still holds a wait on the same server: never
                    # take that for a failure.
                    continue
                if not self._stop.is_set():
                    if self.failure_note() is None:  # a stranger's note: not a failure of ours
                        return
                    self.failed.set()
                    self._on_failure()
                return
        except StoreError:
            return  # a lost store is reported by the heartbeat and the membership watch
        finally:
            self._watch_store.close()

    def stop(self, wait: bool = False) -> None:
        """Stop watching ``failed``; returns at once unless ``wait`` (see MembershipWatch.stop)."""
        self._stop.set()
        if wait:
            self._thread.join(timeout=5)

    # -- failures ---------------------------------------------------------------------------
    def report_failure(self, headline: str) -> bool:
        """Publish our failure; whether we were first (and so must decide for the job)."""
        note = seal(self.signer, self._r("failed"), json.loads(FailureNote(self.node_id, headline).to_json()))
        won = self.round.compare_set("failed", None, note) == note
        self.failed.set()
        return won

    def _r(self, key: str) -> str:
        return f"{self._round_prefix}/{key}"

    def _j(self, key: str) -> str:
        return f"{self._job_prefix}/{key}"

    def failure_note(self) -> FailureNote | None:
        """The round's failure note; None when there is none or it is not signed with the
        job's token (a stranger's note is ignored, with a warning naming the key)."""
        raw = self.round.try_get("failed")
        if raw is None:
            return None
        if self.signer.enabled:
            try:
                unseal(self.signer, self._r("failed"), raw)
            except RendezvousStateError as e:
                log.warning("ignored %s", e)
                return None
        return FailureNote.from_json(raw)

    def decide(self, policy: RestartPolicy, cause: str) -> Decision:
        """Run the restart policy on the job-wide state and publish the decision (winner only)."""
        raw = self.job.try_get(POLICY_KEY)
        state = policy.initial_state() if raw is None else _policy_state(raw, self.signer, self._j(POLICY_KEY))
        # Wall time: the deciding node changes from failure to failure, and monotonic clocks
        # of different hosts share no origin; an intensity window of seconds tolerates skew.
        state, decision = policy.decide(state, Failure(time.time(), cause))
        self.job.set(POLICY_KEY, seal(self.signer, self._j(POLICY_KEY), state.to_json()))
        if isinstance(decision, Restart):
            out = Decision("restart", decision.restart_count, cause, decision.delay_s)
        else:
            assert isinstance(decision, GiveUp)
            out = Decision("give_up", state.restart_count, decision.reason)
        self.round.set("decision", seal(self.signer, self._r("decision"), dict(out.__dict__)))
        return out

    def await_decision(self, timeout: float) -> Decision | None:
        """The decision of the node that failed first; None if it died before deciding."""
        try:
            raw = self.round.get("decision", timeout)
        except StoreTimeout:
            return None
        data = unseal(self.signer, self._r("decision"), raw)
        try:
            return Decision.from_json(json.dumps(data).encode())
        except (KeyError, TypeError, ValueError):
            raise RendezvousStateError(f"store key {self._r('decision')!r} holds a malformed decision "
                                       f"{data!r}; use a fresh --rdzv-id") from None

    # -- finishing --------------------------------------------------------------------------
    def exit_barrier(self, world: int, timeout: float,
                     lost: Callable[[], str | None] | None = None) -> bool:
        """Wait for every node of the round to finish; False when a failure came first.

        ``lost`` names a peer found dead meanwhile (None while all beat): that node never
        finishes, so waiting on would only spend the whole timeout; this node's workers did
        finish, and it leaves as it would at the timeout.
        """
        if self.round.add("finished", 1) >= world:
            self.round.set("all_finished", b"1")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.failed.is_set() or self.round.try_get("failed") is not None:
                return False
            gone = lost() if lost is not None else None
            if gone is not None:
                log.warning("exit barrier: not waiting for the rest: %s", gone)
                return True
            try:
                self.round.wait(["all_finished"], min(0.5, max(0.001, deadline - time.monotonic())))
                return True
            except StoreTimeout:
                continue
        return True  # peers that never finish within the timeout do not hold this node forever

    def depart(self, world: int, host: bool, timeout: float, lost: int = 0) -> None:
        """Say this node is done with the store; the node hosting it waits for everyone.

        The host of a c10d store takes the store down when it exits, so it leaves last:
        a peer still reading the round's keys would otherwise fail a job that succeeded.
        ``lost`` peers (seen dead in the exit barrier) never depart; the host does not wait
        for them.
        """
        try:
            if self.round.add("departed", 1) >= world:
                self.round.set("all_departed", b"1")
            if not host:
                return
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    self.round.wait(["all_departed"], min(0.2, max(0.001, deadline - time.monotonic())))
                    return
                except StoreTimeout:
                    if lost and self.round.add("departed", 0) >= world - lost:
                        return
        except StoreError:
            pass  # the job is done; a peer that vanished meanwhile changes nothing


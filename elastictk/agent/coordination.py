"""What the agents of one job agree on through the store, beyond membership.

- **Failure propagation.** The first agent whose worker fails writes the round's ``failed``
  key (compare-and-set, so exactly one wins); every other agent is blocked on that key in a
  thread and stops its workers the moment it appears, instead of leaving them hung in a
  collective until a backend timeout.
- **A job-wide restart budget.** Only the winner of ``failed`` runs the restart policy, on the
  policy state kept in the job's store, and publishes the decision; so ``--max-restarts``
  means the same for the whole job however many agents there are, and every node sees the
  same ``TORCHELASTIC_RESTART_COUNT``.
- **Only the job's nodes count.** With a job token (``--rdzv-token``) every record here (the
  failure note, the decision and who makes it, the policy state, ``master``, the exit-barrier
  marks) is sealed for the run (:mod:`elastictk.rendezvous.sealed`); one that does not verify
  is absent: a stranger's ``failed`` is no failure and never wins the compare-and-set, a forged
  budget or decision is never read, so nobody without the token can spend the budget or
  change the restart count. When no decision comes (the deciding node died, or a stranger
  kept it from deciding), a surviving node takes over and charges the failure: a failure is
  never forgiven.
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

from .._safejson import Unreadable, loads_object
from ..rendezvous import RoundInfo
from ..rendezvous.auth import Signer
from ..rendezvous.errors import RendezvousInterrupted, RendezvousStateError, RoundAbandoned
from ..rendezvous.sealed import Follower, Records
from ..store import Store, StoreClosed, StoreError, StoreTimeout, free_port
from .noderanks import node_ranges  # noqa: F401 - re-exported: the agent imports it from here
from .address import is_ip
from .outcome import DecisionAction
from .policy import Failure, GiveUp, PolicyState, Restart, RestartPolicy

POLICY_KEY = "policy"
DECIDER_KEY = "decider"  # in the round's store: the one node that charges this round's failure
_OPEN = Signer(None)
log = logging.getLogger("elastictk.agent")


def seal(signer: Signer, name: str, body: dict[str, Any]) -> bytes:
    """``body`` as JSON, signed for store key ``name`` when the job has a token."""
    return json.dumps(signer.seal(name, body), separators=(",", ":"), sort_keys=True).encode()


def unseal(signer: Signer, name: str, raw: bytes) -> dict[str, Any]:
    """The JSON object at ``name``, its MAC checked over the raw bytes before they are parsed
    (and again over the parsed record); errors are one line naming the key."""
    raw = bytes(raw)
    signer.check_raw(name, raw)
    try:
        data = loads_object(raw)
    except Unreadable as e:
        raise RendezvousStateError(f"store key {name!r} holds {len(raw)} bytes that are not a JSON "
                                   f"record ({e}); use a fresh --rdzv-id or clear the store") from None
    body = signer.check(name, data)
    return {k: v for k, v in body.items() if k != "mac"}


def records_of(store: Store | Records, signer: Signer = _OPEN, prefix: str = "") -> Records:
    """``store`` as sealed records (a :class:`Records` is returned as it is)."""
    return store if isinstance(store, Records) else Records(store, prefix, signer)


@dataclass(frozen=True)
class FailureNote:
    """Who failed first in a round, in words every node can print."""

    node_id: str
    headline: str

    def to_json(self) -> bytes:
        return json.dumps({"node_id": self.node_id, "headline": self.headline}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "FailureNote":
        """The note in ``raw``; never raises: bytes that are not a note read as an unreadable one."""
        try:
            return cls.from_record(loads_object(raw))
        except (ValueError, KeyError, TypeError):
            return cls("?", f"unreadable failure note ({len(raw)} bytes)")

    @classmethod
    def from_record(cls, data: Any) -> "FailureNote":
        return cls(str(data["node_id"])[:200], str(data["headline"])[:2000])


@dataclass(frozen=True)
class Decision:
    """What the job does after a round's failure; the same on every node."""

    action: DecisionAction  # its string value is accepted too
    restart_count: int
    reason: str
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        # ValueError for an action that is neither: from_json's callers treat it as bad JSON.
        object.__setattr__(self, "action", DecisionAction(self.action))

    def to_json(self) -> bytes:
        return json.dumps(self.record()).encode()  # {"action": "restart", ...}: the value

    def record(self) -> dict[str, Any]:
        return {"action": self.action.value, "restart_count": self.restart_count,
                "reason": self.reason, "delay_s": self.delay_s}

    @classmethod
    def from_json(cls, raw: bytes) -> "Decision":
        """The decision in ``raw``; ValueError (one line) for anything else."""
        try:
            return cls.from_record(loads_object(raw))
        except (KeyError, TypeError) as e:
            raise ValueError(f"decision record: expected action, restart_count and reason ({e!r} "
                             f"missing or of the wrong type)") from None

    @classmethod
    def from_record(cls, data: Any) -> "Decision":
        """KeyError/TypeError for a missing or mistyped field, ValueError for a bad value."""
        count, delay = data["restart_count"], data.get("delay_s", 0.0)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"decision record: restart_count {str(count)[:40]!r} is not a count")
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay < 1e9:
            raise ValueError(f"decision record: delay_s {str(delay)[:40]!r} is not seconds")
        return cls(DecisionAction(str(data["action"])), count, str(data["reason"])[:2000], float(delay))


def agree_master(info: RoundInfo, addr: str, timeout: float, records: Records | None = None,
                 stop: Callable[[], bool] | None = None, port: int | None = None) -> tuple[str, int]:
    """MASTER_ADDR/PORT for the workers' own store: group rank 0 picks them and tells the others
    (a sealed record: a value that does not verify is waited past, never used). ``stop()``
    true (the agent was signalled) ends the wait with :class:`RendezvousInterrupted`. ``port``:
    rank 0's store already listening there (agent/master.py), else a free port."""
    rec = records or Records(info.store, info.store_prefix, _OPEN)
    if info.rank == 0:
        port = port or free_port(addr if is_ip(addr) else "0.0.0.0")
        rec.write("master", {"addr": addr, "port": port})
        return addr, port
    data = rec.wait("master", timeout, stop=stop)
    if data is None and stop is not None and stop():
        raise RendezvousInterrupted(f"stopped waiting for {rec.name('master')!r}: interrupted")
    if data is None:  # rank 0 writes it at once: it died (or was cut off) after the round closed
        raise RoundAbandoned(f"no MASTER_ADDR/PORT from group rank 0 in {rec.name('master')!r} within "
                             f"{timeout:g}s: it was lost after round {info.round} closed")
    try:
        host, port = str(data["addr"]), int(data["port"])
    except (KeyError, TypeError, ValueError):
        raise RendezvousStateError(f"store key {rec.name('master')!r} holds a malformed record {data!r}; "
                                   "use a fresh --rdzv-id") from None
    if not 0 < port < 65536 or not host or any(c.isspace() for c in host):
        raise RendezvousStateError(f"store key {rec.name('master')!r}: bad address {host!r}:{port}")
    return host, port


class Budget:
    """The job-wide restart state (``policy`` in the job's store), sealed.

    A record that does not verify (forged, replayed from another run, garbled) is absent; and
    what this node reads never goes below the newest state it has seen or written: deleting
    the record, or writing back an older sealed one, does not give the job its restarts back.
    """

    def __init__(self, records: Records) -> None:
        self.records = records
        self.seen: PolicyState | None = None

    def _read(self) -> tuple[PolicyState | None, bytes | None]:
        raw = self.records.store.try_get(POLICY_KEY)
        data = self.records.open(POLICY_KEY, raw)
        if data is None:
            return self.seen, raw
        try:
            state = PolicyState.from_json(data)
        except ValueError as e:
            if self.records.signer.enabled:  # sealed by the job yet unreadable: a bug, not a forgery
                self.records.ignored(POLICY_KEY, str(e))
                return self.seen, raw
            raise RendezvousStateError(f"store key {self.records.name(POLICY_KEY)!r}: {e}; "
                                       "use a fresh --rdzv-id") from None
        if self.seen is not None and state.restart_count < self.seen.restart_count:
            self.records.ignored(POLICY_KEY, f"restart count {state.restart_count} is below the "
                                 f"{self.seen.restart_count} this node has seen (replayed)")
            return self.seen, raw
        self.seen = state
        return state, raw

    def restart_count(self) -> int:
        """Failures the job has restarted from so far (TORCHELASTIC_RESTART_COUNT)."""
        state, _ = self._read()
        return 0 if state is None else state.restart_count

    def spend(self, policy: RestartPolicy, cause: str, progressed: bool | None = None) -> Decision:
        """Charge one failure; compare-and-set, so agents failing at the same moment each
        charge theirs. Bytes that do not verify are replaced, as if absent. ``progressed``:
        whether a rank completed a step in the failed attempt (the crash-loop count), if known."""
        for _ in range(1000):
            state, raw = self._read()
            new, decision = policy.decide(state or policy.initial_state(), Failure(time.time(), cause, progressed))
            if self.records.replace(POLICY_KEY, raw, new.to_json()):
                self.seen = new
                if isinstance(decision, Restart):
                    return Decision(DecisionAction.RESTART, decision.restart_count, cause, decision.delay_s)
                assert isinstance(decision, GiveUp)
                return Decision(DecisionAction.GIVE_UP, new.restart_count, decision.reason)
        raise StoreError("restart budget: 1000 compare-and-set conflicts on the policy state")


def restart_count(job: Store | Records | Budget, signer: Signer = _OPEN, prefix: str = "") -> int:
    """Failures the job has restarted from so far (what workers see as TORCHELASTIC_RESTART_COUNT)."""
    budget = job if isinstance(job, Budget) else Budget(records_of(job, signer, prefix))
    return budget.restart_count()


class RoundCoordinator:
    """One agent's view of one round's shared keys, with a thread that watches ``failed``."""

    def __init__(self, job: Store, round_store: Store, node_id: str, on_failure: Callable[[], None],
                 signer: Signer = _OPEN, where: tuple[str, str] = ("", ""),
                 budget: Budget | None = None, on_error: Callable[[BaseException], None] | None = None) -> None:
        self.job = job
        self.round = round_store
        self.signer = signer
        self._job_prefix, self._round_prefix = where  # full key names, for MACs and errors
        self.budget = budget or Budget(Records(job, self._job_prefix, signer))
        self.records = self.budget.records.view(round_store, self._round_prefix)
        self.node_id = node_id
        self.failed = threading.Event()
        self.watch_error: BaseException | None = None
        self._on_failure = on_failure
        self._on_error = on_error
        self._stop = threading.Event()
        self._watch_store = round_store.clone()
        self._thread = threading.Thread(target=self._watch, name="elastictk-failure-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        """Wake the agent when a failure note of this run appears. A value that does not
        verify is no failure and does not end the watch; anything unexpected is logged with
        its cause and wakes the agent (which treats it as a store it cannot use)."""
        watch = Follower(self.records.view(self._watch_store, self._round_prefix), "failed")
        failing_since: float | None = None
        try:
            while not self._stop.is_set():
                try:
                    note = watch.wait(1.0)
                    failing_since = None
                except StoreClosed:
                    return
                except StoreError as e:
                    # Briefly unavailable (an etcd election): keep watching; a store that is
                    # gone for good is reported by the heartbeat and the membership watch.
                    watch.close()
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since > 60:
                        raise
                    log.debug("failure watch: store unavailable: %s", e)
                    self._stop.wait(0.5)
                    continue
                except RendezvousStateError as e:  # garbage (no token): a failure we cannot read
                    log.warning("failure watch: %s", e)
                    note = {"node_id": "?", "headline": str(e)}
                if note is None:
                    continue
                if not self._stop.is_set():
                    self.failed.set()
                    self._on_failure()
                return
        except Exception as e:  # noqa: BLE001 - never die silently: log the cause, wake the agent
            log.error("failure watch of round store %r stopped: %r", self._round_prefix, e, exc_info=True)
            self.watch_error = e
            if not self._stop.is_set() and self._on_error is not None:
                self._on_error(e)
        finally:
            watch.close()
            self._watch_store.close()

    def stop(self, wait: bool = False) -> None:
        """Stop watching ``failed``; returns at once unless ``wait`` (see MembershipWatch.stop)."""
        self._stop.set()
        if wait:
            self._thread.join(timeout=5)

    # -- failures ---------------------------------------------------------------------------
    def report_failure(self, headline: str) -> bool:
        """Publish our failure; whether we were first (and so must decide for the job). A
        value there that does not verify is replaced: a stranger never wins."""
        won, _ = self.records.claim("failed", {"node_id": self.node_id, "headline": headline[:2000]})
        self.failed.set()
        return won

    def _r(self, key: str) -> str:
        return self.records.name(key)

    def failure_note(self) -> FailureNote | None:
        """The round's failure note; None when there is none or it does not verify (a
        stranger's note is ignored, with a warning naming the key)."""
        raw = self.round.try_get("failed")
        try:
            data = self.records.open("failed", raw)
        except RendezvousStateError:
            return None if raw is None else FailureNote.from_json(raw)  # no token: as before
        if data is None:
            return None
        try:
            return FailureNote.from_record(data)
        except (KeyError, TypeError):
            return FailureNote("?", f"unreadable failure note ({len(raw or b'')} bytes)")

    def decide(self, policy: RestartPolicy, cause: str, progressed: bool | None = None) -> Decision | None:
        """Run the restart policy on the job-wide state and publish the decision: only the
        node that holds the round's ``decider`` record charges the round's failure. None when
        another node took it and has not published in time. ``progressed`` is the deciding
        node's word on whether a rank completed a step this attempt (synchronous training
        steps every rank together, so one node's ranks speak for the job's)."""
        won, _ = self.records.claim(DECIDER_KEY, {"node_id": self.node_id})
        if not won:
            return self.await_decision(30.0)
        out = self.budget.spend(policy, cause, progressed)
        self.records.write("decision", out.record())
        return out

    def publish(self, decision: Decision, timeout: float) -> Decision | None:
        """Publish a decision already charged (an in-place recovery that falls back): unless
        another node decides for this round, then its decision."""
        won, _ = self.records.claim(DECIDER_KEY, {"node_id": self.node_id})
        if not won:
            return self.await_decision(timeout)
        self.records.write("decision", decision.record())
        return decision

    def take_over(self, policy: RestartPolicy, cause: str, timeout: float) -> Decision:
        """No decision came: one surviving node charges the failure and decides (an OTP
        supervisor escalates; it never forgives a failure). If that node dies too, this one
        charges it itself."""
        won, _ = self.records.claim(DECIDER_KEY, {"node_id": self.node_id, "took_over": True})
        if won:
            out = self.budget.spend(policy, cause)
            self.records.write("decision", out.record())
            return out
        got = self.await_decision(timeout)
        return got if got is not None else self.budget.spend(policy, cause)

    def await_decision(self, timeout: float) -> Decision | None:
        """The decision of the node that failed first; None if it died before deciding. A
        decision that does not verify is never read: it is waited past."""
        data = self.records.wait("decision", timeout)
        if data is None:
            return None
        try:
            return Decision.from_record(data)
        except (KeyError, TypeError, ValueError):
            raise RendezvousStateError(f"store key {self._r('decision')!r} holds a malformed decision "
                                       f"{data!r}; use a fresh --rdzv-id") from None

    # -- finishing --------------------------------------------------------------------------
    def _failed_here(self) -> bool:
        if self.failed.is_set():
            return True
        raw = self.round.try_get("failed")
        try:
            return self.records.open("failed", raw) is not None
        except RendezvousStateError:
            return raw is not None  # no token: any note counts, as before

    def exit_barrier(self, world: int, timeout: float,
                     lost: Callable[[], str | None] | None = None,
                     members: list[str] | None = None) -> bool:
        """Wait for every node of the round to finish; False when a failure came first.

        Each node writes its own sealed ``finished/<node_id>`` mark and waits for the marks of
        all ``members`` (a mark that does not verify is not there; without ``members`` the
        marks of ``world`` nodes, whoever wrote them). ``lost`` names a peer found dead
        meanwhile (None while all beat): that node never finishes, so waiting on would only
        spend the whole timeout; this node's workers did finish, and it leaves as it would at
        the timeout.
        """
        self.records.write(f"finished/{self.node_id}", {"node_id": self.node_id})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._failed_here():
                return False
            gone = lost() if lost is not None else None
            if gone is not None:
                log.warning("exit barrier: not waiting for the rest: %s", gone)
                return True
            missing = self._missing("finished", world, members)
            if not missing:
                return True
            try:
                self.round.wait(missing[:1], min(0.5, max(0.001, deadline - time.monotonic())))
            except StoreTimeout:
                continue
            if self.round.try_get(missing[0]) is not None and missing == self._missing("finished", world, members):
                time.sleep(min(0.25, max(0.001, deadline - time.monotonic())))  # not believed: poll
        return True  # peers that never finish within the timeout do not hold this node forever

    def _missing(self, what: str, world: int, members: list[str] | None) -> list[str]:
        """The ``<what>/<node_id>`` marks not (validly) written yet."""
        if members is not None:
            keys = [f"{what}/{m}" for m in members]
            return [k for k, raw in zip(keys, self.round.multi_get(keys)) if not self.records.trusted(k, raw)]
        keys = self.round.keys(f"{what}/")[:4 * world + 64]
        good = sum(1 for k, raw in zip(keys, self.round.multi_get(keys)) if self.records.trusted(k, raw))
        return [] if good >= world else [f"{what}/?"]

    def depart(self, world: int, host: bool, timeout: float, lost: int = 0,
               members: list[str] | None = None) -> None:
        """Say this node is done with the store; the node hosting it waits for everyone.

        The host of a c10d store takes the store down when it exits, so it leaves last:
        a peer still reading the round's keys would otherwise fail a job that succeeded.
        ``lost`` peers (seen dead in the exit barrier) never depart; the host does not wait
        for them.
        """
        try:
            self.records.write(f"departed/{self.node_id}", {"node_id": self.node_id})
            if not host:
                return
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                missing = self._missing("departed", world, members)
                if len(missing) <= lost:
                    return
                time.sleep(min(0.2, max(0.001, deadline - time.monotonic())))
        except StoreError:
            pass  # the job is done; a peer that vanished meanwhile changes nothing

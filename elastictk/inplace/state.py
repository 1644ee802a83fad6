"""The training state a job carries across membership changes, with an in-memory commit point.

``State`` holds two kinds of things, registered by keyword: *stateful* objects (anything with
``state_dict``/``load_state_dict``: a model, an optimizer, an LR scheduler, a sampler) and
*plain values* (the step, an epoch, a data position: ints, floats, strings, lists, dicts).

``commit()`` copies all of it in memory (tensors are cloned, nothing touches disk), so a
worker can commit after every step; ``rollback()`` puts the last commit back. Why rollback:
when a peer dies mid-step, some ranks may have applied the step and others not, and gradients
that were being reduced are lost; going back to the last commit on every survivor and redoing
the step gives exactly the weights a fault-free run would have.

The commit also travels: ``to_bytes()``/``load_bytes()`` serialize it (``torch.save``; read back
with ``weights_only=True``, so a peer's bytes can hold tensors and plain data but no code), which
is how a replacement worker receives the state from a survivor over the process group.

Snapshots (docs/snapshots.md): with a tier configured (``elastictk-run --snapshot local|disk``,
the ``ELASTICTK_SNAPSHOT*`` environment, or ``State(..., snapshot_dir=DIR)`` in code),
``commit()`` serializes the state once into a preallocated buffer (the agent's shared memory for
the local tier) instead of cloning it, a background thread checksums it and writes the disk
tier, and ``restore()`` loads the newest step every rank holds whole, after a restart.
"""
from __future__ import annotations

import copy
import io
import logging
import os
import pickle
from typing import Any, Optional, Protocol, runtime_checkable

from ..snapshot.settings import Settings, SettingsError

log = logging.getLogger("elastictk.inplace")
_warned_no_tier = False  # the "restored nothing" line is said once per process
# elastictk.faults.env.ENV_LOG, named here: faults is a sibling layer (tests assert they agree)
ENV_LOG = "ELASTICTK_FAULT_LOG"


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


class StateError(RuntimeError):
    """State used wrongly (rollback before any commit, an unknown name); says what to do."""


_LAZY = object()  # the last commit lives in the snapshot buffer; decoded when needed


class State:
    """User-registered training state; attribute access reads and writes the registered names.

    ::

        state = State(model=model, optimizer=opt, step=0)
        state.step += 1
        state.commit()

    With snapshots, a plain script adds ``state.restore()`` once the process group exists::

        state = State(model=model, optimizer=opt, step=0)   # elastictk-run --snapshot local ...
        state.restore()                                      # the newest step all ranks hold
        while state.step < steps:
            ...; state.step += 1
            state.commit()

    ``snapshot`` (``"local"``, ``"disk"``, ``"local,disk"``), ``snapshot_dir``,
    ``snapshot_every`` and ``snapshot_overlap`` (pipelined commits: the optimizer's tensors are
    copied during the next step) override the launcher's settings (``ELASTICTK_SNAPSHOT*``); a
    ``snapshot_dir`` alone turns the disk tier on (how a script gets snapshots under torchrun).
    """

    _RESERVED = frozenset({"commit", "rollback", "committed", "committed_step", "to_bytes",
                           "load_bytes", "names", "restore", "flush", "snapshot", "snapshot_dir",
                           "snapshot_every", "snapshot_overlap"})

    def __init__(self, *, snapshot: Optional[str] = None, snapshot_dir: Optional[str] = None,
                 snapshot_every: Optional[int] = None, snapshot_overlap: Optional[bool] = None,
                 **entries: Any) -> None:
        objects: dict[str, Stateful] = {}
        values: dict[str, Any] = {}
        for name, value in entries.items():
            if name.startswith("_") or name in self._RESERVED:
                raise StateError(f"State entry {name!r}: the name is reserved; pick another")
            if isinstance(value, Stateful) and not isinstance(value, type):
                objects[name] = value
            else:
                values[name] = value
        _check_entries(objects, values)
        object.__setattr__(self, "_objects", objects)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_restore_called", False)
        object.__setattr__(self, "_commit", None)
        object.__setattr__(self, "_commit_values", None)
        object.__setattr__(self, "_commits", 0)
        object.__setattr__(self, "_snap", None)
        try:
            settings = Settings.resolve(os.environ, tiers=snapshot, directory=snapshot_dir,
                                        every=snapshot_every, overlap=snapshot_overlap)
        except SettingsError as e:
            raise StateError(str(e)) from None
        object.__setattr__(self, "_snap_settings", settings)

    # -- attribute access -------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        objects, values = self.__dict__["_objects"], self.__dict__["_values"]
        if name in objects:
            return objects[name]
        if name in values:
            return values[name]
        raise AttributeError(f"State has no entry {name!r}{_did_you_mean(name, [*objects, *values])}; "
                             f"register it: State({name}=...)")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._objects:
            raise StateError(f"State entry {name!r} is a stateful object; change it in place, "
                             "do not rebind it")
        if name not in self._values:
            raise StateError(f"State has no entry {name!r}{_did_you_mean(name, self.names)}; "
                             f"register it up front: State({name}=...)")
        self._values[name] = value

    @property
    def names(self) -> list[str]:
        return sorted([*self._objects, *self._values])

    # -- commit and rollback ----------------------------------------------------------------
    def _capture(self) -> dict[str, Any]:
        return {
            "objects": {n: copy.deepcopy(o.state_dict()) for n, o in self._objects.items()},
            "values": copy.deepcopy(self._values),
        }

    def _snapshotter(self) -> Any:
        """The snapshot writer, made on first use (ranks known by then), or None without tiers."""
        if self._snap is None and self._snap_settings.enabled:
            from ..snapshot.worker import Snapshotter

            rank, world = _rank_world()
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
            snap = Snapshotter(self._snap_settings, rank=rank, world=world,
                               local_rank=int(os.environ.get("ELASTICTK_LOCAL_RANK")
                                              or os.environ.get("LOCAL_RANK") or 0),
                               local_world=local_world)
            object.__setattr__(self, "_snap", snap if snap.active else False)
        elif self._snap:
            self._snap.moved(*_rank_world())  # run_elastic: a new generation may renumber ranks
        return self._snap or None

    def commit(self) -> None:
        """Snapshot everything: the point ``rollback`` returns to, and with snapshot tiers the
        step ``restore`` finds after a restart. Blocks only while the previous snapshot is
        still being checksummed or written to disk."""
        snap = self._snapshotter()
        object.__setattr__(self, "_commits", self._commits + 1)
        if snap is None:
            object.__setattr__(self, "_commit", self._capture())
            return
        if not self._restore_called:
            _say_restore_forgotten()
            object.__setattr__(self, "_restore_called", True)  # said once per State
        values = copy.deepcopy(self._values)
        step = int(values.get("step", self._commits))
        guard: frozenset[int] = frozenset()
        if snap.overlap:  # the optimizers wait for the copy of what they change (snapshot/overlap.py)
            from ..snapshot.overlap import guarded

            snap.gate.attach(self._objects.values())
            guard = frozenset(guarded(self._objects.values()))
        try:
            snap.commit({"objects": {n: o.state_dict() for n, o in self._objects.items()},
                         "values": values}, step, guard)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            culprit = self._unpicklable()
            if culprit is None:
                raise
            raise StateError(f"State entry {culprit[0]!r} ({culprit[1]}) cannot be saved in a "
                             f"snapshot ({type(e).__name__}: {e}); keep plain data (ints, floats, "
                             "strings, lists, dicts, tensors) or objects with state_dict() in "
                             "State, and build the rest again after a restart") from None
        object.__setattr__(self, "_commit", _LAZY)
        object.__setattr__(self, "_commit_values", values)

    def _unpicklable(self) -> Optional[tuple[str, str]]:
        """The first entry a snapshot cannot serialize, and its type: named in the error instead
        of a pickler's message about ``<lambda>`` in every rank."""
        for name, value in sorted(self._values.items()):
            try:
                pickle.dumps(value)
            except Exception:  # noqa: BLE001 - any failure names this entry
                return name, type(value).__name__
        for name, obj in sorted(self._objects.items()):
            try:
                pickle.dumps(obj.state_dict())
            except Exception:  # noqa: BLE001
                return name, f"{type(obj).__name__}.state_dict()"
        return None

    def flush(self) -> None:
        """Wait until the last commit is checksummed and (when due) written to disk."""
        snap = self._snapshotter()
        if snap is not None:
            snap.wait()

    def restore(self) -> Optional[int]:
        """Load the newest step every rank holds whole in some snapshot tier; that step, or None
        (nothing to restore: a first start, or no tier configured). With WORLD_SIZE > 1 call it
        after ``init_process_group``: the ranks agree on the step over the default group."""
        object.__setattr__(self, "_restore_called", True)
        snap = self._snapshotter()
        if snap is None:
            _say_nothing_restored()
            _record_restored(None)
            return None
        got = snap.restore(lambda: {"objects": {n: o.state_dict() for n, o in self._objects.items()},
                                    "values": self._values})  # where a DTensor goes, now
        if got is None:
            _record_restored(None)
            return None
        from ..snapshot.into import copy_tree

        self._check_names(got.state, "the snapshot")
        for name, obj in self._objects.items():
            part = got.state["objects"][name]
            if not got.owned:  # views of memory that changes: copied into the tensors held now
                part = copy_tree(part, obj.state_dict())
            obj.load_state_dict(part)  # in place already: the same tensors, nothing copied again
        values = got.state["values"]
        self._values.clear()
        self._values.update(copy.deepcopy(values))
        object.__setattr__(self, "_commit", _LAZY)
        object.__setattr__(self, "_commit_values", values)
        _record_restored(got.step)
        return got.step

    def _last_commit(self) -> Any:
        """The last commit as a dict (decoded from the snapshot buffer, fresh tensors)."""
        if self._commit is _LAZY:
            last = self._snap.last()
            assert last is not None
            return last[1]
        return self._commit

    @property
    def committed(self) -> bool:
        return self._commit is not None

    def committed_step(self, key: str = "step") -> int:
        """The plain value ``key`` of the last commit (-1 without a commit); how peers compare
        who holds the newest state."""
        if self._commit is None:
            return -1
        values = self._commit_values if self._commit is _LAZY else self._commit["values"]
        return int(values.get(key, 0))

    def rollback(self) -> None:
        """Restore the last commit. The commit itself stays untouched (a deep copy is loaded:
        optimizers keep references to the tensors they are given)."""
        if self._commit is None:
            raise StateError("rollback() before any commit(); call state.commit() once the "
                             "state is initialized")
        snap = copy.deepcopy(self._commit) if self._commit is not _LAZY else self._last_commit()
        for name, obj in self._objects.items():
            obj.load_state_dict(snap["objects"][name])
        self._values.clear()
        self._values.update(snap["values"])

    def _check_names(self, snap: Any, whose: str) -> None:
        missing = (set(self._objects) - set(snap["objects"])) | (set(self._values) - set(snap["values"]))
        if missing:
            raise StateError(f"{whose} lacks {sorted(missing)}; every rank must register "
                             "the same State entries")

    # -- travelling -------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The last commit, serialized for a peer."""
        if self._commit is None:
            raise StateError("to_bytes() before any commit(); commit first")
        buf = io.BytesIO()
        import torch

        torch.save(self._last_commit(), buf)
        return buf.getvalue()

    def load_bytes(self, data: bytes) -> None:
        """Make a peer's serialized commit this state's commit, and roll back to it."""
        import torch

        snap = torch.load(io.BytesIO(data), weights_only=True)
        self._check_names(snap, "the peer's state")
        object.__setattr__(self, "_restore_called", True)  # a peer's commit is a restore too
        object.__setattr__(self, "_commit", snap)
        self.rollback()

    def __repr__(self) -> str:
        return f"State({', '.join(self.names)}; committed={self.committed})"


def _record_restored(step: Optional[int]) -> None:
    """Under elastictk-chaos (``ELASTICTK_FAULT_LOG``), one ``restored`` line: the step this
    process resumed at (None: nothing restored), so steps lost are judged from what the job did
    (elastictk/chaos/lost.py), never from its output; the data record numbers the batches
    trained from that step on (elastictk/data/record.py). Outside chaos: nothing."""
    path = os.environ.get(ENV_LOG)
    if not path:
        return
    from ..data import record

    record.resumed(step)
    import json
    import time

    entry = {"restored": step, "rank": _env_int("RANK"), "attempt": _env_int("TORCHELASTIC_RESTART_COUNT") or 0,
             "pid": os.getpid(), "monotonic": time.monotonic()}
    try:  # one O_APPEND write: lines from several workers never interleave
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, (json.dumps(entry) + "\n").encode())
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("elastictk: cannot append to %s=%s: %s", ENV_LOG, path, e.strerror or e)


def _env_int(name: str) -> Optional[int]:
    try:
        return int(os.environ.get(name, ""))
    except ValueError:
        return None


def _say_nothing_restored() -> None:
    """A restarted worker calling ``restore()`` with no tier restores nothing and its job starts
    again from the beginning: say so, once per process (a first start has nothing to restore,
    so it stays quiet)."""
    global _warned_no_tier
    raw = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    try:
        count = int(raw)
    except ValueError:
        return
    if count <= 0 or _warned_no_tier:
        return
    _warned_no_tier = True
    log.warning("elastictk: state.restore() in restart %d restored nothing: no snapshot tier is "
                "configured, so training starts again from the state's initial values; pass "
                "elastictk-run --snapshot local (or disk), or State(snapshot_dir=DIR)", count)


def _say_restore_forgotten() -> None:
    """A restarted worker that commits to a snapshot tier without ever calling ``restore()``
    starts again from the state's initial values although the tier may hold its last step, and
    the job still ends well: say so, once per State (a first start has nothing to restore)."""
    try:
        count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", ""))
    except ValueError:
        return
    if count <= 0:
        return
    log.warning("elastictk: rank %s commits in restart %d without state.restore(): the steps the "
                "snapshot tiers hold are ignored and training starts again from the state's "
                "initial values; call state.restore() once after init_process_group",
                os.environ.get("RANK", "?"), count)


_STATEFUL_NAMES = frozenset({"model", "module", "optimizer", "optim", "opt", "scheduler",
                             "lr_scheduler", "sampler", "scaler", "grad_scaler"})


def _check_entries(objects: dict[str, Stateful], values: dict[str, Any]) -> None:
    """Mistakes that would train silently wrong: a name that means an object given as a plain
    value (``optimizer='adam'``), and an optimizer over parameters no registered module has (it
    was built over another model, so restore and rollback would not move what it trains)."""
    for name, value in values.items():
        if name in _STATEFUL_NAMES:
            raise StateError(f"State({name}={_short(value)}): {name!r} is a "
                             f"{type(value).__name__}, not an object with state_dict() and "
                             f"load_state_dict(); pass the {name} itself")
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return
    modules = [o for o in objects.values() if isinstance(o, torch.nn.Module)]
    if not modules:
        return
    owned = {id(p) for m in modules for p in m.parameters()}
    for name, obj in objects.items():
        if isinstance(obj, torch.optim.Optimizer):
            params = [p for g in obj.param_groups for p in g["params"]]
            if params and not any(id(p) in owned for p in params):
                raise StateError(f"State entry {name!r}: the optimizer updates none of the "
                                 "parameters of the registered module(s) "
                                 f"{sorted(n for n, o in objects.items() if o in modules)}; build "
                                 "it over model.parameters() of the model in State (after moving "
                                 "or wrapping it)")


def _did_you_mean(name: str, names: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _rank_world() -> tuple[int, int]:
    from ..data.world import rank_world  # lazily: elastictk.data imports torch

    return rank_world()

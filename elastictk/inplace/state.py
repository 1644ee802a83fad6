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
"""
from __future__ import annotations

import copy
import io
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


class StateError(RuntimeError):
    """State used wrongly (rollback before any commit, an unknown name); says what to do."""


class State:
    """User-registered training state; attribute access reads and writes the registered names.

    ::

        state = State(model=model, optimizer=opt, step=0)
        state.step += 1
        state.commit()
    """

    _RESERVED = frozenset({"commit", "rollback", "committed", "committed_step", "to_bytes",
                           "load_bytes", "names"})

    def __init__(self, **entries: Any) -> None:
        objects: dict[str, Stateful] = {}
        values: dict[str, Any] = {}
        for name, value in entries.items():
            if name.startswith("_") or name in self._RESERVED:
                raise StateError(f"State entry {name!r}: the name is reserved; pick another")
            if isinstance(value, Stateful) and not isinstance(value, type):
                objects[name] = value
            else:
                values[name] = value
        object.__setattr__(self, "_objects", objects)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_commit", None)

    # -- attribute access -------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        objects, values = self.__dict__["_objects"], self.__dict__["_values"]
        if name in objects:
            return objects[name]
        if name in values:
            return values[name]
        raise AttributeError(f"State has no entry {name!r}; register it: State({name}=...)")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._objects:
            raise StateError(f"State entry {name!r} is a stateful object; change it in place, "
                             "do not rebind it")
        if name not in self._values:
            raise StateError(f"State has no entry {name!r}; register it up front: State({name}=...)")
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

    def commit(self) -> None:
        """Snapshot everything in memory; the point ``rollback`` returns to."""
        object.__setattr__(self, "_commit", self._capture())

    @property
    def committed(self) -> bool:
        return self._commit is not None

    def committed_step(self, key: str = "step") -> int:
        """The plain value ``key`` of the last commit (-1 without a commit); how peers compare
        who holds the newest state."""
        if self._commit is None:
            return -1
        return int(self._commit["values"].get(key, 0))

    def rollback(self) -> None:
        """Restore the last commit. The commit itself stays untouched (a deep copy is loaded:
        optimizers keep references to the tensors they are given)."""
        if self._commit is None:
            raise StateError("rollback() before any commit(); call state.commit() once the "
                             "state is initialized")
        snap = copy.deepcopy(self._commit)
        for name, obj in self._objects.items():
            obj.load_state_dict(snap["objects"][name])
        self._values.clear()
        self._values.update(snap["values"])

    # -- travelling -------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The last commit, serialized for a peer."""
        if self._commit is None:
            raise StateError("to_bytes() before any commit(); commit first")
        buf = io.BytesIO()
        import torch

        torch.save(self._commit, buf)
        return buf.getvalue()

    def load_bytes(self, data: bytes) -> None:
        """Make a peer's serialized commit this state's commit, and roll back to it."""
        import torch

        snap = torch.load(io.BytesIO(data), weights_only=True)
        missing = (set(self._objects) - set(snap["objects"])) | (set(self._values) - set(snap["values"]))
        if missing:
            raise StateError(f"the peer's state lacks {sorted(missing)}; every rank must register "
                             "the same State entries")
        object.__setattr__(self, "_commit", snap)
        self.rollback()

    def __repr__(self) -> str:
        return f"State({', '.join(self.names)}; committed={self.committed})"

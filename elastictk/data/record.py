"""What each rank trained, per step, for ``elastictk-chaos``'s exactly-once check.

Under ``elastictk-chaos`` (``ELASTICTK_FAULT_LOG`` set) every batch ``elastictk.data.DataLoader``
hands to the loop is one JSON line in the workers' fault log: the dataset indices, the epoch
and the step the batch trains in. ``elastictk/chaos/samples.py`` rebuilds the run's final
history from these lines alone (a step redone after a rollback counts once) and checks that
every sample of every finished epoch was trained exactly once. Outside chaos: nothing is
written and nothing is kept.

Which step a batch trains in, in the job's numbering (``state.step`` after the step):

- under ``run_elastic``: the step it is about to run (:func:`at_step`, told by the loop);
- otherwise: the step ``State.restore()`` brought back (:func:`resumed`; 0 on a first start)
  plus the batches handed since, one step per batch. A process of a restarted job that never
  called ``restore()`` has no known step: its lines say ``"step": null`` and the check says
  the verdict is unknown, and why.

Lines carry indices, so they are kept for datasets of at most :data:`MAX_SAMPLES` samples; a
bigger dataset writes one ``"off"`` line instead, and the check reports "unknown".
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional, Sequence

ENV_LOG = "ELASTICTK_FAULT_LOG"  # elastictk.faults.env.ENV_LOG (faults is a higher layer)
MAX_SAMPLES = 65536  # indices per line stay small; a bigger dataset is not recorded

_base: Optional[int] = None   # the step State.restore() resumed at (None: not told)
_handed = 0                   # batches handed since _base was set
_loop: Optional[tuple[int, int, int]] = None  # run_elastic's (step about to run, attempt, world)
_in_step = False              # a batch was handed since run_elastic named its step
_off_said: set[str] = set()


def on() -> bool:
    """Whether a chaos run is recording (the only time anything here does work)."""
    return bool(os.environ.get(ENV_LOG))


def resumed(step: Optional[int]) -> None:
    """``State.restore()`` brought the job back at ``step`` (None: nothing to restore, step 0)."""
    global _base, _handed
    _base, _handed = int(step or 0), 0


def resumed_at() -> Optional[int]:
    """The step the last ``State.restore()`` of this process brought back (0: nothing to
    restore), or None when it was not called (or not under chaos): where the job's own step
    numbering stands before this process's first step (``elastictk.faults.auto`` counts on
    from it)."""
    return _base


def at_step(step: int, attempt: int, world: int) -> None:
    """``run_elastic`` is about to run step ``step`` (the value ``state.step`` will have after
    it) in the generation whose restart count is ``attempt``, of ``world`` ranks."""
    global _loop, _in_step
    _loop, _in_step = (int(step), int(attempt), int(world)), False


def _attempt() -> int:
    if _loop is not None:
        return _loop[1]
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return -1


def _step(advance: bool) -> Optional[int]:
    """The step of the batch being handed (``advance``), or of the last batch handed (an
    epoch's end: it ends after that step)."""
    global _handed, _in_step
    if _loop is not None:
        _in_step = _in_step or advance
        return _loop[0] if _in_step else _loop[0] - 1
    if advance:
        _handed += 1
    base = _base if _base is not None else (0 if _attempt() == 0 else None)
    return None if base is None else base + _handed


def batch(epoch: int, indices: Sequence[int], padding: Sequence[int], samples: int) -> None:
    """One batch handed to the loop: ``indices`` of the dataset, ``padding`` the indices that
    pad the epoch's short last global batch (trained again by design)."""
    if not on():
        return
    if samples > MAX_SAMPLES:
        off(f"the dataset has {samples} samples, more than the {MAX_SAMPLES} recorded per batch")
        return
    _write({"data": "batch", "epoch": int(epoch), "step": _step(True), "indices": [int(i) for i in indices],
            "padding": [int(i) for i in padding], "samples": int(samples)})


def end(epoch: int, dropped: Sequence[int], samples: int) -> None:
    """The loop saw the end of ``epoch``; ``dropped``: indices left out by design (drop_last)."""
    if not on() or samples > MAX_SAMPLES:
        return
    _write({"data": "end", "epoch": int(epoch), "step": _step(False),
            "dropped": [int(i) for i in dropped], "samples": int(samples)})


def off(why: str) -> None:
    """This process's batches are not recorded: one line saying why (once per reason)."""
    if not on() or why in _off_said:
        return
    _off_said.add(why)
    _write({"data": "off", "why": why})


def _write(entry: dict[str, object]) -> None:
    """One line, with who wrote it and which run of the job it belongs to: ``attempt`` (the
    restart count), ``world`` and ``base`` (the step ``State.restore()`` resumed at; -1 under
    ``run_elastic``). A membership change restarts every worker without a restart counted, so
    the three together tell the runs apart (elastictk/chaos/samples.py)."""
    world = _loop[2] if _loop is not None else (_env_int("WORLD_SIZE") or 1)
    base = -1 if _loop is not None else (_base if _base is not None else 0)
    entry.update({"rank": _env_int("RANK"), "attempt": _attempt(), "world": world, "base": base,
                  "pid": os.getpid(), "monotonic": time.monotonic()})
    path = os.environ.get(ENV_LOG)
    if not path:
        return
    try:  # one O_APPEND write: lines from several workers never interleave
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, (json.dumps(entry, separators=(",", ":")) + "\n").encode())
        finally:
            os.close(fd)
    except OSError as e:
        import logging

        logging.getLogger("elastictk.data").warning("elastictk: cannot append to %s=%s: %s",
                                                    ENV_LOG, path, e.strerror or e)


def _env_int(name: str) -> Optional[int]:
    try:
        return int(os.environ.get(name, ""))
    except ValueError:
        return None


def _reset() -> None:
    """Forget the step (tests)."""
    global _base, _handed, _loop, _in_step
    _base, _handed, _loop, _in_step = None, 0, None, False
    _off_said.clear()

"""The disk tier, written with ``torch.distributed.checkpoint`` (DCP) so any world size can read it.

Layout under ``--snapshot-dir``::

    step-0000000120/__0_0.distcp      each rank's tensors (DCP's FileSystemWriter, fsynced)
    step-0000000120/__1_0.distcp
    step-0000000120/.metadata         DCP's: where every tensor's chunks are (the coordinator's)
    step-0000000120/skeleton.pt       the state's structure and plain values (rank 0)
    step-0000000120/COMPLETE          step, world size and an XXH3-64 checksum of every file

Why a ``COMPLETE`` of our own after DCP's ``.metadata``: DCP writes ``.metadata`` only after
every rank's write returned, so it already means "all parts are in"; but nothing in DCP checks
the bytes later, and a torn file (a partial copy, a bad sector) would load as wrong weights or
fail deep inside ``dcp.load``. So after the save each rank checksums the files it wrote, rank 0
gathers them over the snapshot's own process group and writes ``COMPLETE`` with all of them,
then keeps the newest :data:`~elastictk.snapshot.settings.KEEP` complete steps. A restore
checks the files first (each rank a share) and a step with any torn file is not used.

The tensors go to DCP under flat keys, one per tensor path in the state (``objects/model/0.weight``);
everything else (optimizer hyper-parameters, the step) stays in ``skeleton.pt``, read back with
``weights_only=True`` (plain data, no code: DCP's own path for non-tensors unpickles freely).
Tensors that are not DTensors are *replicated* (DDP-style: every rank holds the same), and DCP
writes one copy; DTensors (FSDP2) are sharded and DCP keeps each shard. A load at any world
size reads the whole of a replicated tensor, and for a DTensor exactly the chunks its new local
shard covers (DCP's resharding), into the current objects' own DTensors as the template.
"""
from __future__ import annotations

import io
import json
import mmap
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

from .codec import checksum
from .reshard import _is_dtensor, paths, remap
from .settings import KEEP

COMPLETE = "COMPLETE"
SKELETON = "skeleton.pt"
MARK = "__etk_dcp__"
_STEP_DIR = re.compile(r"step-(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:010d}"


def _write_atomic(path: Path, chunks: list[Any]) -> None:
    """Write to a temporary name, fsync, rename into place, fsync the directory."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        for c in chunks:
            f.write(c)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def tensor_key(path: tuple[Any, ...]) -> str:
    """A DCP key for a tensor's path (``objects/optimizer/state/#0/momentum_buffer``)."""
    return "/".join(k.replace("%", "%25").replace("/", "%2F").replace("#", "%23")
                    if isinstance(k, str) else f"#{k}" for k in path)


def flatten(tree: Any) -> tuple[Any, dict[str, Any]]:
    """``tree`` with each tensor replaced by ``{MARK: key}``, and the tensors by key."""
    flat: dict[str, Any] = {}

    def mark(path: tuple[Any, ...], t: Any) -> Any:
        key = tensor_key(path)
        flat[key] = t
        return {MARK: key}

    return remap(tree, mark), flat


def unflatten(skeleton: Any, flat: dict[str, Any]) -> Any:
    from collections import OrderedDict

    if isinstance(skeleton, dict):
        if len(skeleton) == 1 and MARK in skeleton:
            return flat[skeleton[MARK]]
        out = OrderedDict() if isinstance(skeleton, OrderedDict) else {}
        for k, v in skeleton.items():
            out[k] = unflatten(v, flat)
        return out
    if isinstance(skeleton, list):
        return [unflatten(v, flat) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(unflatten(v, flat) for v in skeleton)
    return skeleton


def keys(skeleton: Any) -> list[str]:
    out: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if len(x) == 1 and MARK in x:
                out.append(x[MARK])
                return
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(skeleton)
    return out


def file_sum(path: Path) -> int:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return checksum(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return checksum(m)


class DcpDisk:
    """One rank's view of the disk tier (``rank``/``world``: this process's, now)."""

    def __init__(self, root: str, rank: int, world: int, keep: int = KEEP) -> None:
        self.root, self.rank, self.world, self.keep = Path(root), rank, world, keep
        self._group: Any = None

    # -- saving (the background thread, over the snapshot's own group) -------------------------
    def group(self) -> Any:
        """The process group saves run on, made on the training thread (a collective: every
        rank commits the same steps). Its own group, so the background save's collectives never
        interleave with the training thread's on the default group. None alone (no group)."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not (dist.is_available() and dist.is_initialized()) or self.world == 1:
            return None
        if self._group is None or self._group not in c10d._world.pg_map:  # re-formed: new group
            self._group = dist.new_group(backend="gloo")
        return self._group

    def forget_group(self) -> None:
        self._group = None

    def save(self, step: int, tree: Any, group: Any) -> bool:
        """Write ``tree`` as step ``step``; True on rank 0 once ``COMPLETE`` is written."""
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        d = step_dir(self.root, step)
        d.mkdir(parents=True, exist_ok=True)
        skeleton, flat = flatten(tree)
        if self.rank == 0:
            buf = io.BytesIO()
            torch.save({"step": step, "tree": skeleton}, buf)
            _write_atomic(d / SKELETON, [buf.getvalue()])
        writer = dcp.FileSystemWriter(str(d), sync_files=True, thread_count=1, overwrite=True)
        with warnings.catch_warnings():  # alone (no group): DCP warns it assumes one process
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(flat, storage_writer=writer, process_group=group, no_dist=group is None)
        mine = {p.name: file_sum(p) for p in d.glob(f"__{self.rank}_*.distcp")}
        if self.rank == 0:
            mine.update({n: file_sum(d / n) for n in (SKELETON, ".metadata")})
        sums: list[Any] = [mine]
        if group is not None:
            sums = [None] * self.world if self.rank == 0 else []
            dist.gather_object(mine, sums if self.rank == 0 else None, dst=0, group=group)
        if self.rank != 0:
            return False
        files = {k: f"{v:016x}" for s in sums for k, v in s.items()}
        marker = {"step": step, "world_size": self.world, "files": files}
        _write_atomic(d / COMPLETE, [json.dumps(marker, sort_keys=True).encode()])
        self.prune()
        return True

    # -- finding and checking ------------------------------------------------------------------
    def _marker(self, step: int) -> Optional[dict[str, Any]]:
        try:
            m = json.loads((step_dir(self.root, step) / COMPLETE).read_text())
        except (OSError, ValueError):
            return None
        ok = isinstance(m, dict) and m.get("step") == step and isinstance(m.get("files"), dict)
        return m if ok else None

    def complete_steps(self) -> list[int]:
        """Complete steps, newest first, whatever world size wrote them."""
        try:
            entries = list(self.root.iterdir())
        except OSError:
            return []
        found = (int(m.group(1)) for m in (_STEP_DIR.match(p.name) for p in entries) if m)
        return sorted((s for s in found if self._marker(s) is not None), reverse=True)

    def prune(self) -> None:
        complete = self.complete_steps()
        if not complete:
            return
        oldest_kept = min(complete[:self.keep])
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and int(m.group(1)) < oldest_kept:
                shutil.rmtree(p, ignore_errors=True)

    def verify(self, step: int) -> Optional[str]:
        """This rank's share of the step's files checked against ``COMPLETE``: None if whole,
        else why not (the ranks split the files, so each is read once)."""
        m = self._marker(step)
        if m is None:
            return f"{step_dir(self.root, step) / COMPLETE} is missing or unreadable"
        d = step_dir(self.root, step)
        for i, name in enumerate(sorted(m["files"])):
            if i % self.world != self.rank:
                continue
            try:
                got = f"{file_sum(d / name):016x}"
            except OSError as e:
                return f"cannot read {d / name}: {e.strerror or e}"
            if got != m["files"][name]:
                return f"{name}: checksum {got} != {m['files'][name]}"
        return None

    # -- loading (every rank on its own: no collective) ----------------------------------------
    def load(self, step: int, template: Any) -> Any:
        """Step ``step``'s state, resharded onto ``template``'s DTensors where it has them."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        d = step_dir(self.root, step)
        reader = dcp.FileSystemReader(str(d))
        meta = reader.read_metadata().state_dict_metadata
        skeleton = torch.load(d / SKELETON, weights_only=True)["tree"]
        like = {tensor_key(p): t for p, t in paths(template)} if template is not None else {}
        dest: dict[str, Any] = {}
        for key in keys(skeleton):
            md = meta.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise RuntimeError(f"{d} has no tensor {key!r}; was it written by this script?")
            t = like.get(key)
            if t is not None and _is_dtensor(t) and tuple(t.shape) == tuple(md.size):
                dest[key] = torch.empty_like(t)  # a DTensor on this world's mesh: DCP reshards
            else:
                dest[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        if dest:
            with warnings.catch_warnings():  # "assuming ... a single process": by design, no_dist
                warnings.simplefilter("ignore", UserWarning)
                try:
                    dcp.load(dest, storage_reader=reader, no_dist=True)
                except CheckpointException as e:  # a BaseException: make it an error to handle
                    raise RuntimeError(_first_cause(e)) from None
        return unflatten(skeleton, dest)


def _first_cause(e: BaseException) -> str:
    """DCP's exception holds each rank's failure; the first one's type and message."""
    failures = getattr(e, "failures", None) or {}
    for err in failures.values():
        cause = err[0] if isinstance(err, tuple) else getattr(err, "exc", err)  # (exc, frames)
        return f"{type(cause).__name__}: {cause}"
    return str(e)

"""The disk tier, written with ``torch.distributed.checkpoint`` (DCP) so any world size can read it.

Layout under ``--snapshot-dir``::

    step-0000000120/__0_0.distcp      each rank's tensors (DCP's FileSystemWriter, fsynced)
    step-0000000120/__1_0.distcp
    step-0000000120/.metadata         DCP's: where every tensor's chunks are (the coordinator's)
    step-0000000120/skeleton.pt       the state's structure and plain values (rank 0)
    step-0000000120/COMPLETE          step, world size, an XXH3-64 checksum of every file and
                                      a SHA-256 of .metadata and skeleton.pt; sealed (trust.py)

A step is written into a private temporary directory (``mkdtemp``: mode 0700, a name nobody
can predict) inside ``--snapshot-dir`` and renamed to ``step-N`` once ``COMPLETE`` is in it:
nothing another user planted (a symlink at ``step-N`` or at a file DCP writes) is followed,
every file is mode 0600, and a step directory is never reused. A restore opens no file of a
step before :mod:`.trust` accepted its directory and ``COMPLETE``'s seal, and gives DCP the
``.metadata`` bytes it checked (SHA-256) rather than letting DCP open and unpickle the file.

Why a ``COMPLETE`` of our own after DCP's ``.metadata``: DCP writes ``.metadata`` only after
every rank's write returned, so it already means "all parts are in"; but nothing in DCP checks
the bytes later, and a torn file (a partial copy, a bad sector) would load as wrong weights or
fail deep inside ``dcp.load``. So after the save each rank checksums the files it wrote, rank 0
gathers them over the snapshot's own process group and writes ``COMPLETE`` with all of them,
then keeps the newest :data:`~elastictk.snapshot.settings.KEEP` complete steps. A restore
checks the files first (each rank a share) and a step with any torn file is not used.

The tensors go to DCP under flat keys, one per tensor path in the state (``dcptree.py``);
everything else (optimizer hyper-parameters, the step) stays in ``skeleton.pt``, read back with
``weights_only=True`` (plain data, no code: DCP's own path for non-tensors unpickles freely).
Tensors that are not DTensors are *replicated* (DDP-style: every rank holds the same), and DCP
writes one copy; DTensors (FSDP2) are sharded and DCP keeps each shard. A load at any world
size reads the whole of a replicated tensor, and for a DTensor exactly the chunks its new local
shard covers (DCP's resharding), into the current objects' own DTensors as the template.
"""
from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import pickle
import re
import shutil
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

from . import trust
from .codec import checksum
from .dcptree import flatten, keys, tensor_key, unflatten
from .reshard import _is_dtensor, paths
from .settings import KEEP

COMPLETE = "COMPLETE"
SKELETON = "skeleton.pt"
METADATA = ".metadata"
_STEP_DIR = re.compile(r"step-(\d+)$")
_TEMP_DIR = re.compile(r"\.step-(\d+)\.")  # a step being written (or left by a killed job)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:010d}"


def _write_new(path: Path, data: bytes) -> None:
    """Create ``path`` (mode 0600; never an existing file, never through a symlink), fsynced."""
    fd = os.open(path, _CREATE, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _private_files(d: Path, names: list[str]) -> None:
    """Mode 0600 for the files DCP created in ``d`` (with the umask's mode): fchmod through an
    fd opened without following a link."""
    for name in names:
        fd = os.open(d / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)


def make_root(root: Path) -> None:
    """Create the snapshot directory mode 0700 where missing; refuse one that is not private
    (:func:`.trust.private_dir`)."""
    if not os.path.lexists(root):
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
        except OSError as e:
            raise trust.Refused(f"cannot create {root}: {e.strerror or e}") from None
    trust.private_dir(root)


def file_sum(path: Path) -> int:
    """XXH3-64 of regular file ``path`` (never through a symlink)."""
    fd = os.open(path, trust.READ_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise trust.Refused(f"{path.name} is not a regular file")
        if st.st_size == 0:
            return checksum(b"")
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m:
            return checksum(m)
    finally:
        os.close(fd)


class DcpDisk:
    """One rank's view of the disk tier (``rank``/``world``: this process's, now)."""

    def __init__(self, root: str, rank: int, world: int, keep: int = KEEP,
                 key: Optional[str] = None) -> None:
        self.root, self.rank, self.world, self.keep = Path(root), rank, world, keep
        self.key = key  # seals COMPLETE (trust.py); None: the directory checks alone
        self.refused: dict[int, str] = {}  # the last complete_steps(): step (-1: the directory) -> why
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

    def drop_group(self) -> None:
        """Destroy the snapshot's group and forget it, now: its C++ destructor (which closes its
        connections and joins gloo's threads) runs here, on this thread, while the interpreter
        is whole, not whenever the last reference happens to go during interpreter shutdown;
        and a peer still waiting in one of its collectives fails now instead of at a timeout.
        A group already out of torch's registry (the default group destroyed) is only dropped."""
        group, self._group = self._group, None
        if group is None:
            return
        from torch.distributed import distributed_c10d as c10d

        if group in c10d._world.pg_map:
            try:
                c10d.destroy_process_group(group)
            except (RuntimeError, ValueError) as e:  # gone meanwhile: dropping it is what is left
                warnings.warn(f"elastictk: the snapshot's process group: {e}", RuntimeWarning,
                              stacklevel=2)
        del group

    def save(self, step: int, tree: Any, group: Any) -> bool:
        """Write ``tree`` as step ``step``; True on rank 0 once ``COMPLETE`` is written.
        Collective over ``group``: rank 0 makes the private directory every rank writes into."""
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        d: Optional[Path] = None
        problem = ""
        if self.rank == 0:
            try:
                make_root(self.root)
                d = Path(tempfile.mkdtemp(prefix=f".step-{step:010d}.", dir=self.root))
            except (OSError, trust.Refused) as e:
                problem = str(e) if isinstance(e, trust.Refused) else f"{e.strerror or e}"
        if group is not None:  # every rank learns the directory, or that there is none
            box = [str(d) if d is not None else problem]
            dist.broadcast_object_list(box, src=0, group=group)
            d, problem = (Path(box[0]), "") if os.path.isabs(box[0]) else (None, box[0])
        if d is None:
            raise trust.Refused(f"{self.root} refused: {problem}")
        try:
            return self._save_into(d, step, tree, group, torch, dist, dcp)
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            raise

    def _save_into(self, d: Path, step: int, tree: Any, group: Any, torch: Any, dist: Any,
                   dcp: Any) -> bool:
        skeleton, flat = flatten(tree)
        if self.rank == 0:
            buf = io.BytesIO()
            torch.save({"step": step, "tree": skeleton}, buf)
            _write_new(d / SKELETON, buf.getvalue())
        writer = dcp.FileSystemWriter(str(d), sync_files=True, thread_count=1, overwrite=False)
        with warnings.catch_warnings():  # alone (no group): DCP warns it assumes one process
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(flat, storage_writer=writer, process_group=group, no_dist=group is None)
        names = sorted(p.name for p in d.glob(f"__{self.rank}_*.distcp"))
        if self.rank == 0:
            names += [SKELETON, METADATA]
        _private_files(d, names)
        mine = {n: file_sum(d / n) for n in names}
        strong = {n: _sha256(d / n) for n in (SKELETON, METADATA)} if self.rank == 0 else {}
        sums: list[Any] = [mine]
        if group is not None:
            sums = [None] * self.world if self.rank == 0 else []
            dist.gather_object(mine, sums if self.rank == 0 else None, dst=0, group=group)
        if self.rank != 0:
            return False
        files = {k: f"{v:016x}" for s in sums for k, v in s.items()}
        marker = {"step": step, "world_size": self.world, "files": files, "sha256": strong}
        final = step_dir(self.root, step)
        body = json.dumps(marker, sort_keys=True).encode()
        _write_new(d / COMPLETE, trust.seal(self.key, final.name, body))
        _fsync_dir(d)
        self._put(d, final)
        self.prune()
        return True

    def _put(self, d: Path, final: Path) -> None:
        """Rename the written step into place. A step directory of ours by the same number (a
        step redone after a restore from an older one) is moved aside first and removed; one
        that is not ours, or a symlink, is refused and left as it is."""
        aside: Optional[Path] = None
        if os.path.lexists(final):
            try:
                trust.private_dir(final)
            except trust.Refused as e:
                raise trust.Refused(f"{final} exists and is not this job's to replace ({e}); "
                                    "remove it") from None
            aside = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=self.root))
            os.rename(final, aside / "old")
        os.rename(d, final)
        _fsync_dir(self.root)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)

    # -- finding and checking ------------------------------------------------------------------
    def check(self, step: int) -> dict[str, Any]:
        """Step ``step``'s marker, once its directories are private and its seal verifies;
        :class:`.trust.Refused` otherwise. ``COMPLETE`` is the only file read here."""
        trust.private_dir(self.root)
        d = step_dir(self.root, step)
        trust.private_dir(d)
        raw = trust.read_small(d / COMPLETE, trust.MAX_MARKER)
        return trust.parse_body(trust.unseal(raw, self.key, d.name), step)

    def _marker(self, step: int) -> Optional[dict[str, Any]]:
        try:
            return self.check(step)
        except trust.Refused as e:
            if str(e) != f"{COMPLETE} is missing":  # not a step being written: a refused one
                self.refused[step] = str(e)
            return None

    def complete_steps(self) -> list[int]:
        """Complete steps that verify, newest first, whatever world size wrote them; the steps
        refused on the way are in :attr:`refused` (step: why)."""
        self.refused = {}
        try:
            trust.private_dir(self.root)
        except trust.Refused as e:
            if os.path.lexists(self.root):
                self.refused[-1] = str(e)
            return []
        try:
            entries = list(self.root.iterdir())
        except OSError:
            return []
        found = (int(m.group(1)) for m in (_STEP_DIR.match(p.name) for p in entries) if m)
        return sorted((s for s in found if self._marker(s) is not None), reverse=True)

    def prune(self) -> None:
        """Keep the newest :attr:`keep` complete steps; remove older steps and the temporary
        directories of older steps (a job killed while writing leaves one). Only directories
        of this user are removed (``rmtree`` never follows a link out of them)."""
        complete = self.complete_steps()
        if not complete:
            return
        oldest_kept = min(complete[:self.keep])
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name) or _TEMP_DIR.match(p.name)
            if m and int(m.group(1)) < oldest_kept:
                try:
                    st = os.lstat(p)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                    shutil.rmtree(p, ignore_errors=True)

    def verify(self, step: int) -> Optional[str]:
        """This rank's share of the step's files checked against ``COMPLETE``: None if whole,
        else why not (the ranks split the tensor files, so each is read once; the files read
        into memory at load, ``.metadata`` and ``skeleton.pt``, every rank checks there)."""
        try:
            m = self.check(step)
        except trust.Refused as e:
            return str(e)
        d = step_dir(self.root, step)
        shares = [n for n in sorted(m["files"]) if n not in m["sha256"]]
        for i, name in enumerate(shares):
            if i % self.world != self.rank:
                continue
            try:
                got = f"{file_sum(d / name):016x}"
            except (OSError, trust.Refused) as e:
                why = e.strerror if isinstance(e, OSError) else str(e)
                return f"cannot read {d / name}: {why or e}"
            if got != m["files"][name]:
                return f"{name}: checksum {got} != {m['files'][name]}"
        for name in sorted(m["sha256"]):
            try:
                self._small(step, m, name)
            except trust.Refused as e:
                return str(e)
        return None

    def _small(self, step: int, m: dict[str, Any], name: str) -> bytes:
        """The bytes of ``.metadata`` or ``skeleton.pt``, read once and checked (SHA-256)
        against the verified marker ``m``: what is parsed is what was checked."""
        raw = trust.read_small(step_dir(self.root, step) / name, trust.MAX_SMALL)
        got = hashlib.sha256(raw).hexdigest()
        if got != m["sha256"][name]:
            raise trust.Refused(f"{name}: SHA-256 {got[:16]}... is not the one in COMPLETE")
        return raw

    # -- loading (every rank on its own: no collective) ----------------------------------------
    def load(self, step: int, template: Any) -> Any:
        """Step ``step``'s state, resharded onto ``template``'s DTensors where it has them."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        d = step_dir(self.root, step)
        m = self.check(step)  # again: the seal, before the files it vouches for are parsed
        reader = checked_reader(str(d), self._small(step, m, METADATA))
        meta = reader.read_metadata().state_dict_metadata
        skeleton = torch.load(io.BytesIO(self._small(step, m, SKELETON)), weights_only=True)["tree"]
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


def _sha256(path: Path) -> str:
    return hashlib.sha256(trust.read_small(path, trust.MAX_SMALL)).hexdigest()


def _checked_reader_class() -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(dcp.FileSystemReader):
        """DCP's reader, but ``.metadata`` comes from bytes checked against the sealed marker
        (DCP's own reader opens the file again and unpickles whatever is there then)."""

        def __init__(self, path: str, metadata: bytes) -> None:
            super().__init__(path)
            self._metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            md = pickle.loads(self._metadata)  # noqa: S301 - verified: trust.py
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return CheckedReader


def checked_reader(path: str, metadata: bytes) -> Any:
    return _checked_reader_class()(path, metadata)


def _first_cause(e: BaseException) -> str:
    """DCP's exception holds each rank's failure; the first one's type and message."""
    failures = getattr(e, "failures", None) or {}
    for err in failures.values():
        cause = err[0] if isinstance(err, tuple) else getattr(err, "exc", err)  # (exc, frames)
        return f"{type(cause).__name__}: {cause}"
    return str(e)

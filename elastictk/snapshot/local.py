"""The local tier: snapshots in shared memory owned by this node's agent.

The agent creates one anonymous shared file (``memfd``, nothing in ``/dev/shm``) of
``--snapshot-memory`` bytes, sparse (a page costs memory only once written), cut into one region
per local rank, and gives its workers ``ELASTICTK_SNAPSHOT_REGIONS=/proc/<agent pid>/fd/<fd>``.
The memory outlives every worker (a restarted worker finds its predecessor's snapshot) and dies
with the agent: once the agent and its workers are gone, nothing refers to the file.

A region (native byte order)::

    0      magic "ETKSNAP1" | version u32 | slots u32 (2)
    16     active slot i32 (-1: none) | pinned slot i32 (-1: none; set by the agent while it ships it)
    24     slot size u64
    64     slot 0 meta | 128 slot 1 meta            (64 bytes each, see META)
    512    slot 0 origin | 640 slot 1 origin        (u32 length | UTF-8: where an adopted part came from)
    4096   slot 0 data | slot 0 + slot size: slot 1 data

A commit writes the slot that is not active: its meta goes to WRITING first (the older
snapshot it held is given up), then the data, then the meta (step, length, rank, world),
then READY, then ``active`` flips to it: a worker killed at any point leaves the other slot's
snapshot intact. A slot the agent is shipping to a peer is *pinned* (:meth:`Region.pin`): the
worker's next commits go to the other slot, even the active one, until the agent unpins it, so a
send slower than the steps still delivers a whole part (the replica lags instead of tearing).
The checksum of the data (:func:`~.codec.checksum`) is computed afterwards by a
background thread and marked ``checked``. A slot published but never checked (its worker was
killed in between) is not restored: nothing can tell its bytes from bytes changed since, and a
restore that trusted it could load wrong weights, or fail to decode it on every restart; the
other slot, one commit older, is restored instead (:meth:`Region.verify` says why). A worker
given ``ELASTICTK_SNAPSHOT_NOTIFY`` (the write end of a pipe its agent reads, for the peer
tier) then writes one byte there, so the agent ships the slot.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Optional

from .codec import checksum
from .settings import ENV_MEMORY, ENV_REGION_SIZE, ENV_REGIONS, PAGE, human, region_size

MAGIC = b"ETKSNAP1"
VERSION = 3  # 3: the pinned-slot field
SLOTS = 2
MEMFD_NAME = "elastictk-snapshots"
HEADER = struct.Struct("@8sII")
ACTIVE = struct.Struct("@i")
OFF_ACTIVE = 16
OFF_PIN = 20
OFF_SLOT_SIZE = 24
U64 = struct.Struct("@Q")
U32 = struct.Struct("@I")
META_BASE = 64
# state u32 | checked u32 | step q | length Q | checksum Q | rank u32 | world u32 | seq Q
META = struct.Struct("@IIqQQIIQ")
OFF_SUM = 24  # the checksum field within a slot's meta
OFF_ORIGIN, ORIGIN_SIZE = 512, 128
MADV_POPULATE_READ = 22  # Linux 5.14: map a range's pages in one call instead of a fault each
EMPTY, WRITING, READY = 0, 1, 2


def slot_size(region: int) -> int:
    return (region - PAGE) // SLOTS // PAGE * PAGE


class SnapshotTooBig(RuntimeError):
    """A snapshot does not fit its slot; the message names both sizes and the fix."""


class HolderError(RuntimeError):
    """The agent could not create the snapshot memory."""


class Holder:
    """The agent's side: ``with Holder(n, memory) as h: spec.env |= h.env()``."""

    def __init__(self, local_world_size: int, memory: int) -> None:
        self.region = region_size(memory, local_world_size)
        self.memory = memory
        self.n = local_world_size
        size = self.region * local_world_size
        try:
            self._fd: Optional[int] = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
            os.ftruncate(self._fd, size)
        except OSError as e:
            raise HolderError(f"cannot create {human(size)} of snapshot memory: {e.strerror or e}; "
                              "lower --snapshot-memory") from None
        self.path = f"/proc/{os.getpid()}/fd/{self._fd}"
        for r in range(local_world_size):  # headers only: the data pages stay unallocated
            mm = mmap.mmap(self._fd, PAGE, offset=r * self.region)
            HEADER.pack_into(mm, 0, MAGIC, VERSION, SLOTS)
            ACTIVE.pack_into(mm, OFF_ACTIVE, -1)
            ACTIVE.pack_into(mm, OFF_PIN, -1)
            U64.pack_into(mm, OFF_SLOT_SIZE, slot_size(self.region))
            mm.close()

    def env(self) -> dict[str, str]:
        """What workers need to find their region (slot = ``LOCAL_RANK``)."""
        return {ENV_REGIONS: self.path, ENV_REGION_SIZE: str(self.region), ENV_MEMORY: str(self.memory)}

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "Holder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class SlotMeta:
    index: int
    state: int
    checked: bool
    step: int
    length: int
    digest: int
    rank: int
    world: int
    seq: int


class Region:
    """A worker's own region of the agent's memory."""

    def __init__(self, path: str, local_rank: int, size: int, memory: int, local_world: int,
                 notify: Optional[str] = None) -> None:
        self._notify: Optional[int] = None
        if notify:
            try:  # the agent holds the read end: opening cannot block
                self._notify = os.open(notify, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                self._notify = None  # no replication wake-up; the local tier works alone
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            self.mm = mmap.mmap(fd, size, offset=local_rank * size)
        finally:
            os.close(fd)
        magic, version, slots = HEADER.unpack_from(self.mm, 0)
        if magic != MAGIC or version != VERSION or slots != SLOTS:
            self.mm.close()
            raise HolderError(f"{path} is not an elastictk snapshot region of this version; the "
                              "agent and the worker run different elastictk versions")
        self.size, self.memory, self.local_world = size, memory, local_world
        self.slot_size = U64.unpack_from(self.mm, OFF_SLOT_SIZE)[0]
        if self.slot_size != slot_size(size):
            self.mm.close()
            raise HolderError(f"{path}: the region's slot size {self.slot_size} is not that of a "
                              f"{size}-byte region ({slot_size(size)}); the agent and the worker "
                              "disagree on --snapshot-memory or the region was overwritten")

    # -- header ---------------------------------------------------------------------------------
    @property
    def active(self) -> int:
        return int(ACTIVE.unpack_from(self.mm, OFF_ACTIVE)[0])

    def meta(self, i: int) -> SlotMeta:
        state, checked, step, length, digest, rank, world, seq = META.unpack_from(
            self.mm, META_BASE + 64 * i)
        return SlotMeta(i, state, bool(checked), step, length, digest, rank, world, seq)

    def data(self, i: int) -> memoryview:
        start = PAGE + i * self.slot_size
        return memoryview(self.mm)[start:start + self.slot_size]

    def _set_state(self, i: int, state: int) -> None:
        U32.pack_into(self.mm, META_BASE + 64 * i, state)

    # -- writing --------------------------------------------------------------------------------
    def check_fits(self, nbytes: int, step: int, rank: int) -> None:
        if nbytes > self.slot_size:
            need = (nbytes + PAGE - 1) // PAGE * PAGE * SLOTS + PAGE
            raise SnapshotTooBig(
                f"elastictk snapshot: rank {rank}'s snapshot of step {step} is {human(nbytes)}, its "
                f"local slot holds {human(self.slot_size)} (--snapshot-memory {human(self.memory)} "
                f"over {self.local_world} local rank(s), {SLOTS} slots each); raise "
                f"--snapshot-memory to at least {human(need * self.local_world)} or drop the local tier")

    @property
    def pinned(self) -> int:
        """The slot the agent is shipping (-1: none); commits leave it alone."""
        return int(ACTIVE.unpack_from(self.mm, OFF_PIN)[0])

    def pin(self, m: SlotMeta) -> bool:
        """The agent's side: keep slot ``m`` whole while it is sent. False when the worker took
        it meanwhile (its seq or state changed after the pin was set): nothing is pinned then."""
        ACTIVE.pack_into(self.mm, OFF_PIN, m.index)
        now = self.meta(m.index)
        if now.state == READY and now.seq == m.seq and now.checked:
            return True
        self.unpin()
        return False

    def unpin(self) -> None:
        ACTIVE.pack_into(self.mm, OFF_PIN, -1)

    def next_slot(self) -> int:
        """Where the next commit goes: the slot that is not active, unless the agent has it
        pinned; then the active one (the pinned slot stays the whole snapshot meanwhile). A pin
        on a slot that holds no snapshot any more (a restore gave it up) does not hold: writing
        the active slot over then would leave no whole snapshot while it is written."""
        active = self.active
        i = 1 - active if active in (0, 1) else 0
        held = i == self.pinned and active in (0, 1) and self.meta(i).state == READY
        return active if held else i

    def begin(self, slot: Optional[int] = None) -> int:
        """The slot to write next (``slot``: this one), given up (WRITING) before a byte of it
        changes."""
        i = self.next_slot() if slot is None else slot
        self._set_state(i, WRITING)
        U32.pack_into(self.mm, OFF_ORIGIN + ORIGIN_SIZE * i, 0)
        return i

    def publish(self, i: int, step: int, length: int, rank: int, world: int) -> None:
        seq = max(self.meta(0).seq, self.meta(1).seq) + 1
        META.pack_into(self.mm, META_BASE + 64 * i, WRITING, 0, step, length, 0, rank, world, seq)
        self._set_state(i, READY)
        ACTIVE.pack_into(self.mm, OFF_ACTIVE, i)

    def seal(self, i: int) -> int:
        """Compute and record the slot's checksum (background thread)."""
        m = self.meta(i)
        digest = checksum(self.data(i)[:m.length])
        off = META_BASE + 64 * i
        U64.pack_into(self.mm, off + OFF_SUM, digest)
        U32.pack_into(self.mm, off + 4, 1)
        if self._notify is not None:
            try:
                os.write(self._notify, b"\0")
            except OSError:  # the pipe is full (the agent is behind: it reads every slot) or gone
                pass
        return digest

    def adopt(self, step: int, raw: memoryview, rank: int, world: int, origin: str = "",
              digest: Optional[int] = None, slot: Optional[int] = None) -> int:
        """Make ``raw`` (a serialized state, e.g. from disk or a peer) this region's active
        snapshot; ``origin`` says where it came from (what a restore names). ``digest``: its
        checksum, already verified over ``raw`` (a peer's part): stored without reading the
        bytes again (the restore verifies the slot as it loads it). ``slot``: the slot to
        overwrite (the agent's choice, :meth:`evictable`); else the next commit's."""
        self.check_fits(len(raw), step, rank)
        i = self.begin(slot)
        self.data(i)[:len(raw)] = raw
        self.publish(i, step, len(raw), rank, world)
        text = origin.encode()[:ORIGIN_SIZE - U32.size]
        off = OFF_ORIGIN + ORIGIN_SIZE * i
        self.mm[off + U32.size:off + U32.size + len(text)] = text
        U32.pack_into(self.mm, off, len(text))
        if digest is None:
            self.seal(i)
        else:
            meta = META_BASE + 64 * i
            U64.pack_into(self.mm, meta + OFF_SUM, digest)
            U32.pack_into(self.mm, meta + 4, 1)
        return i

    def evictable(self, rank: int, world: int) -> int:
        """The slot an adopted part of ``rank`` in ``world`` may overwrite: one that holds no
        part of it, else the one holding the older step; never the newest."""
        metas = [self.meta(i) for i in range(SLOTS)]
        mine = [m for m in metas if m.state == READY and (m.rank, m.world) == (rank, world)
                and 0 < m.length <= self.slot_size]
        free = [m.index for m in metas if m not in mine]
        return free[0] if free else min(mine, key=lambda m: (m.step, m.seq)).index

    def origin(self, i: int) -> str:
        """Where slot ``i``'s snapshot came from when it was adopted ("" for a commit's own)."""
        off = OFF_ORIGIN + ORIGIN_SIZE * i
        (n,) = U32.unpack_from(self.mm, off)
        end = off + U32.size + min(n, ORIGIN_SIZE - U32.size)
        return bytes(self.mm[off + U32.size:end]).decode(errors="replace")

    def make_active(self, i: int) -> None:
        """After restoring slot ``i``: the other slot (newer but torn, or foreign) is given up."""
        self._set_state(1 - i, EMPTY)
        ACTIVE.pack_into(self.mm, OFF_ACTIVE, i)

    def forget(self) -> None:
        for i in range(SLOTS):
            self._set_state(i, EMPTY)
        ACTIVE.pack_into(self.mm, OFF_ACTIVE, -1)

    # -- reading --------------------------------------------------------------------------------
    def ready(self, rank: int, world: int) -> list[SlotMeta]:
        """Published slots of this rank in this world, newest first."""
        out = [m for m in (self.meta(i) for i in range(SLOTS))
               if m.state == READY and m.rank == rank and m.world == world
               and 0 < m.length <= self.slot_size]
        return sorted(out, key=lambda m: m.seq, reverse=True)

    def verify(self, m: SlotMeta) -> Optional[str]:
        """None if slot ``m`` is whole (its checksum stored and matching), else why not."""
        if not m.checked:
            return "never checksummed: its worker was killed before the check"
        self.populate(m)
        digest = checksum(self.data(m.index)[:m.length])
        if digest != m.digest:
            return f"checksum {digest:016x} != {m.digest:016x}"
        return None

    def populate(self, m: SlotMeta) -> None:
        """Map slot ``m``'s pages into this process in one call: a restarted worker's mapping is
        new, and a page fault per 4 kB page costs more than reading the page."""
        start = PAGE + m.index * self.slot_size
        try:
            self.mm.madvise(MADV_POPULATE_READ, start, (m.length + PAGE - 1) // PAGE * PAGE)
        except (OSError, ValueError):  # older kernels: the reads fault the pages in instead
            pass

    def close(self) -> None:
        if self._notify is not None:
            os.close(self._notify)
            self._notify = None
        try:
            self.mm.close()
        except BufferError:  # a view is still exported; the mapping goes with the process
            pass

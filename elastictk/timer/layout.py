"""The shared-memory contract between a worker's timers and the agent's reaper.

The agent creates one anonymous shared file (``memfd``) per worker group holding
``local_world_size`` regions, one per local rank, and tells its workers where it is with
``ELASTICTK_TIMER_REGIONS=/proc/<agent pid>/fd/<fd>``. Nothing is ever created in ``/dev/shm``:
the memory goes away with the last process that maps it, even if the agent is SIGKILLed.

A worker maps only its own region and writes it without a syscall or a lock; the agent scans
all regions. Region layout (native byte order, every field aligned so that each is written by
one aligned store)::

    0     magic            b"ETKTIMR1" (written by the agent; the worker checks it)
    8     version          u32 | slot count u32
    16    dump signal      u32 (written by the agent) | stacks fd u32 (by the worker)
    24    owner pid        u64 (written by the worker once it has claimed the region)
    32    main thread id   u64 (pthread id of the owner's main thread, to find it in a dump)
    40    scope table len  u64 (bytes of the scope table in use)
    48    next scan        u64 (by the agent: it looks at the region by this monotonic ns)
    56    wake fd          u32 (by the agent: its wake pipe's write end, in its own fd table)
    64    slots            SLOTS x u64 timer words
    1024  scope table      "name\\n" entries; an entry's index is its scope id

A timer word packs a whole timer into 64 bits, so it is written by ONE aligned 8-byte store and
a reader never sees half of one (no seqlock, no sequence counter to bump)::

    word = deadline (a multiple of 2**16 ns) | scope_id       (0 = slot free)

computed by the worker as ``(now | 0xFFFF) + k`` with ``k = round_up(after, 2**16) + scope_id
+ 1`` fixed per timer: one OR and one ADD on the hot path (the carry out of the low 16 bits
moves the deadline up one step and leaves ``scope_id`` behind). ``now`` and the deadline are
``CLOCK_MONOTONIC`` nanoseconds, which on Linux is one clock for every process of the host, so
the worker's deadline and the agent's "now" compare directly. A timer therefore fires between 0
and 131 µs later than asked, far below the reaper's wake-up latency. A slot only ever
goes free -> armed -> free (CPython's ``pack_into`` zeroes the field, then stores the value), so
a scan may miss a timer armed that instant (the next scan sees it) but never acts on a mixed
word; the agent still re-reads an expired word before acting, in case a platform splits stores.

The agent does not poll on a short tick. Before each scan it writes ``next scan``, the latest
time it will look again (the earliest deadline it knows of, at most its idle interval ahead),
and sleeps on a pipe until then. A worker that arms a timer due *before* that time writes one
byte to the pipe (``/proc/<agent pid>/fd/<wake fd>``, opened when it claims the region): the
only syscall on the hot path, and only for a timer shorter than the agent's planned sleep. An
idle job's reaper so wakes once per idle interval instead of a hundred times a second.

A worker claims its region with a POSIX record lock on the region's bytes (released by the
kernel when the process dies, never inherited by its children), so two processes that both
inherited the environment cannot share one region. Its stack dumps go to a memfd of its own
(``stacks fd``), which faulthandler writes when the agent sends the dump signal and the agent
reads through ``/proc/<owner pid>/fd/<stacks fd>`` before it kills the worker.
"""
from __future__ import annotations

import signal
import struct
from typing import Optional

MAGIC = b"ETKTIMR1"
VERSION = 2
REGION_SIZE = 16384  # four pages: an mmap offset must be page aligned
SLOTS = 120
SLOTS_OFFSET = 64
TABLE_OFFSET = 1024
TABLE_SIZE = REGION_SIZE - TABLE_OFFSET
MAX_SCOPE_BYTES = 200  # longer scope names are cut (on a UTF-8 boundary)
UNKNOWN_SCOPE = 0xFFFF  # the scope id of a name that did not fit in the table

OFF_MAGIC = 0
OFF_VERSION = 8
OFF_SIGNAL = 16
OFF_STACKS_FD = 20
OFF_OWNER = 24
OFF_MAIN_THREAD = 32
OFF_TABLE_LEN = 40
OFF_NEXT_SCAN = 48
OFF_WAKE_FD = 56

SCOPE_BITS = 16
SCOPE_MASK = (1 << SCOPE_BITS) - 1
DEADLINE_MASK = ~SCOPE_MASK & 0xFFFF_FFFF_FFFF_FFFF

# Environment the agent gives its workers (the whole interface of a worker to the timers).
ENV_REGIONS = "ELASTICTK_TIMER_REGIONS"
ENV_COLLECTIVE_TIMEOUT = "ELASTICTK_COLLECTIVE_TIMEOUT"
STACKS_MEMFD_NAME = "elastictk-stacks"
# A real-time signal: no library uses one by convention (SIGUSR1/2 often mean "checkpoint now"
# to training scripts), and the agent never forwards it to workers.
DEFAULT_DUMP_SIGNAL = int(signal.SIGRTMIN) + 7

U32 = struct.Struct("@I")
U64 = struct.Struct("@Q")
SLOT_ARRAY = struct.Struct(f"@{SLOTS}Q")
# magic, version, slots, dump signal, stacks fd, owner, main thread, table length
HEADER = struct.Struct("@8sIIIIQQQ")


def slot_offsets() -> list[int]:
    """Byte offsets of the slots, as a stack whose ``pop()`` hands out the lowest first (so a
    worker's timers cluster at the start of its region)."""
    return [SLOTS_OFFSET + 8 * i for i in reversed(range(SLOTS))]


def timer_constant(after_ns: int, scope_id: int) -> int:
    """``k`` of a timer lasting ``after_ns`` in scope ``scope_id`` (see the module docstring)."""
    return ((after_ns + SCOPE_MASK) & DEADLINE_MASK) + (scope_id & SCOPE_MASK) + 1


def arm(now_ns: int, k: int) -> int:
    """The word of a timer with constant ``k`` armed at ``now_ns``; never 0."""
    return ((now_ns | SCOPE_MASK) + k) & 0xFFFF_FFFF_FFFF_FFFF


def decode(word: int) -> tuple[int, int]:
    """``(deadline_ns, scope_id)`` of a non-zero word."""
    return word & DEADLINE_MASK, word & SCOPE_MASK


def init_region(buf: memoryview, offset: int, dump_signal: int, wake_fd: int = 0) -> None:
    """Write a fresh header (and zero the rest) for the region at ``offset``: what the agent
    does before any worker of an attempt starts. ``next scan`` starts in the far future: a
    worker's timers wake the agent until it has looked at the region once."""
    buf[offset:offset + REGION_SIZE] = bytes(REGION_SIZE)
    HEADER.pack_into(buf, offset, MAGIC, VERSION, SLOTS, dump_signal, 0, 0, 0, 0)
    U64.pack_into(buf, offset + OFF_NEXT_SCAN, 0xFFFF_FFFF_FFFF_FFFF)
    U32.pack_into(buf, offset + OFF_WAKE_FD, wake_fd)


def wake_path(regions_path: str, wake_fd: int) -> Optional[str]:
    """``/proc/<agent pid>/fd/<wake fd>`` for regions at ``/proc/<agent pid>/fd/<fd>``."""
    parts = regions_path.split("/")
    if wake_fd <= 0 or len(parts) != 5 or parts[:2] != ["", "proc"] or parts[3] != "fd":
        return None
    return f"/proc/{parts[2]}/fd/{wake_fd}"


def stacks_path(owner_pid: int, stacks_fd: int) -> str:
    return f"/proc/{owner_pid}/fd/{stacks_fd}"


def check_header(buf: memoryview) -> Optional[str]:
    """None if ``buf`` starts with a region this code understands, else what is wrong."""
    magic, version, slots = HEADER.unpack_from(buf, 0)[:3]
    if magic != MAGIC:
        return "it is not an elastictk timer region (bad magic)"
    if version != VERSION or slots != SLOTS:
        return (f"it has layout version {version} with {slots} slots, this elastictk expects "
                f"version {VERSION} with {SLOTS}; the agent and the worker run different "
                "elastictk versions")
    return None


def encode_scope(name: str) -> bytes:
    """A table entry: the name, one line, at most ``MAX_SCOPE_BYTES`` of UTF-8."""
    raw = name.replace("\n", " ").encode("utf-8", "backslashreplace")
    if len(raw) > MAX_SCOPE_BYTES:
        raw = raw[:MAX_SCOPE_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return raw + b"\n"


def decode_table(raw: bytes) -> list[str]:
    """Scope names by id, from the bytes of a table."""
    # Every entry ends with "\n"; anything after the last one is an entry still being written.
    return raw.decode("utf-8", "replace").split("\n")[:-1]

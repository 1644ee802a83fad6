"""Worker-side timers: put a deadline on a region of code, nearly for free.

::

    from elastictk import timer

    with timer.expires(after=30, scope="all_reduce"):
        dist.all_reduce(t)

    @timer.expires(after=600)            # scope: the function's qualified name
    def train_step(batch): ...

    t = timer.acquire(after=5, scope="load")   # explicit form
    ...
    timer.release(t)

If the deadline passes while the region is still running, the agent that started this worker
dumps the worker's stacks and kills it (see ``server.py``). Timers nest, and any thread may hold
them. Outside an elastictk agent (no ``ELASTICTK_TIMER_REGIONS`` in the environment) timers
are inert: the code runs the same, nothing watches it.

Why it is this cheap: acquiring is ``pop()`` a free slot, one ``monotonic_ns()`` (vDSO, no
syscall) and ONE aligned 8-byte store into the worker's shared-memory region; releasing is a
store of 0 and an ``append``. No lock (``list.pop``/``append`` are atomic), no syscall, no
message; the agent finds the deadlines by scanning the region. The region is attached on first
use, so a process that never acquires a timer never maps anything.
"""
from __future__ import annotations

import faulthandler
import functools
import mmap
import os
import sys
import threading
import time
from types import CodeType
from typing import Any, Callable, Optional, TypeVar

from . import layout as L
from .region import TimerError, claim

F = TypeVar("F", bound=Callable[..., Any])

MAX_AFTER = 1e9  # seconds (~31 years): keeps a deadline inside the 64-bit word

# -- process state (module globals: the hot path reads them with the cheapest lookup) ----------
_buf: Any = bytearray(L.REGION_SIZE)  # the region: a memoryview of the mmap, or private bytes
_free: list[int] = []  # free slot offsets; empty until attached, so first use takes the slow path
_attached: Optional[str] = None  # which region this process writes ("<path> region <n>")
_inert_reason: Optional[str] = None
_mmap: Optional[mmap.mmap] = None
_stacks_fd: Optional[int] = None
_region_fd: Optional[int] = None  # kept open: closing it would drop the region's claim
_forked_env: Optional[str] = None  # ELASTICTK_TIMER_REGIONS as inherited through fork()
_lock = threading.Lock()  # slow paths only: attaching, registering a scope name
_sids: dict[str, int] = {}  # scope name -> id, for this process's lifetime
_names: list[str] = []  # id -> scope name
_site_sids: dict[tuple[CodeType, int], int] = {}  # (code, line) of an unnamed timer -> id
_table_len = 0  # bytes of the region's scope table written so far
_table_full = False

_pack = L.U64.pack_into
_unpack = L.U64.unpack_from
_mono = time.monotonic_ns
_NEXT = L.OFF_NEXT_SCAN
_wake_fd = -1  # the agent's wake pipe (see layout): written when a timer is due before its look


def _wake() -> None:
    """Tell the agent a timer is due before its next planned look (a byte on its pipe)."""
    if _wake_fd >= 0:
        try:
            os.write(_wake_fd, b"\0")
        except OSError:  # full: a wake-up is pending anyway; gone: the agent is gone
            pass


# -- the hot path -----------------------------------------------------------------------------
class Timer:
    """One timer, made by :func:`expires`: a context manager, a decorator, or explicit
    (``t.acquire(); ...; t.release()``).

    It may be entered again after it was left (reuse saves its construction), but not while it
    runs; nesting and threads need one object each.
    """

    __slots__ = ("_k", "_slot", "_scope")
    _k: int  # the word constant: (now | 0xFFFF) + _k is the armed word (layout.timer_constant)
    _slot: int  # offset of the slot while running, else -1
    _scope: Optional[str]  # the scope as given (None: named after the call site / function)

    def __enter__(self) -> "Timer":
        if self._slot >= 0:
            raise TimerError("this timer is already running; use one expires() object per "
                             "concurrent or nested region")
        try:
            slot = _free.pop()
        except IndexError:
            slot = _take_slot_slow()
        word = (_mono() | 0xFFFF) + self._k
        _pack(_buf, slot, word)
        if word < _unpack(_buf, _NEXT)[0]:
            _wake()
        self._slot = slot
        return self

    def __exit__(self, typ: object = None, exc: object = None, tb: object = None) -> None:
        slot = self._slot
        _pack(_buf, slot, 0)
        _free.append(slot)
        self._slot = -1

    acquire = __enter__

    def release(self) -> None:
        """End the timer; the region it guarded finished in time."""
        if self._slot < 0:
            raise TimerError("release() of a timer that is not running (released twice, or "
                             "never acquired)")
        self.__exit__()

    @property
    def running(self) -> bool:
        return self._slot >= 0

    @property
    def after(self) -> float:
        """The length in seconds (rounded up to 65.5 µs)."""
        return ((self._k - 1) & L.DEADLINE_MASK) / 1e9

    @property
    def scope(self) -> str:
        sid = (self._k - 1) & L.SCOPE_MASK
        return _names[sid] if sid < len(_names) else f"scope #{sid}"

    def __call__(self, fn: F) -> F:
        """Decorator: every call of ``fn`` runs under a fresh timer of this length."""
        k = self._k
        if self._scope is None:  # named after the function, not the decorator's line
            k = k - ((k - 1) & L.SCOPE_MASK) + scope_id(
                getattr(fn, "__qualname__", None) or repr(fn))

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            try:
                slot = _free.pop()
            except IndexError:
                slot = _take_slot_slow()
            word = (_mono() | 0xFFFF) + k
            _pack(_buf, slot, word)
            if word < _unpack(_buf, _NEXT)[0]:
                _wake()
            try:
                return fn(*args, **kwargs)
            finally:
                _pack(_buf, slot, 0)
                _free.append(slot)

        return timed  # type: ignore[return-value]

    def __repr__(self) -> str:
        state = "running" if self._slot >= 0 else "idle"
        return f"<Timer after={self.after:g}s scope={self.scope!r} {state}>"


_new = object.__new__
_ns_of: dict[float, int] = {}  # after -> ns rounded up to 2**16 (validated); a few hundred at most


def expires(after: float, scope: Optional[str] = None) -> Timer:
    """A timer of ``after`` seconds from when it is entered, named ``scope`` in hang reports.

    ``scope`` defaults to ``file.py:line`` of the call (for the decorator form: the function's
    qualified name). Scopes should be a small set of names: each new one costs a table entry in
    the shared region. A function rather than a class because, in CPython, calling a class with
    keyword arguments builds a dict; this is on every collective's path.
    """
    t = _new(Timer)
    try:
        ns = _ns_of[after]
    except (KeyError, TypeError):
        ns = _after_ns(after)
    if scope is None:
        sid = _site_scope(sys._getframe(1))
    else:
        try:
            sid = _sids[scope]
        except (KeyError, TypeError):
            sid = scope_id(scope)
    t._k = ns + sid + 1
    t._scope = scope
    t._slot = -1
    return t


def _after_ns(after: float) -> int:
    if not 0 <= after <= MAX_AFTER:
        raise TimerError(f"after={after!r}: a timer needs 0 <= after <= {MAX_AFTER:.0e} "
                         "seconds")
    ns = (int(after * 1e9) + L.SCOPE_MASK) & L.DEADLINE_MASK
    if len(_ns_of) < 1024:
        _ns_of[after] = ns
    return ns


def acquire(after: float, scope: Optional[str] = None) -> Timer:
    """Start a timer now; pass the result to :func:`release` when the region is done."""
    t = expires(after, scope if scope is not None else _site_name(sys._getframe(1)))
    t.__enter__()
    return t


def release(timer: Timer) -> None:
    """End a timer from :func:`acquire`."""
    timer.release()


def timed(fn: Callable[..., Any], after: float, scope: str) -> Callable[..., Any]:
    """``fn`` wrapped so that each call runs under a timer (what ``watch_collectives`` uses)."""
    return expires(after, scope)(fn)


# -- slow paths -------------------------------------------------------------------------------
def _take_slot_slow() -> int:
    """First use in this process (attach), or every slot held (an error)."""
    with _lock:
        if _attached is None and _inert_reason is None:
            _attach_from_env_locked()
    try:
        return _free.pop()
    except IndexError:
        raise TimerError(f"{L.SLOTS} timers are held at once in this process; a timer is "
                         "probably acquired in a loop and never released") from None


def scope_id(name: str) -> int:
    """The id of scope ``name`` in this process, registering it (and publishing it to the
    region, if attached) on first use."""
    if not isinstance(name, str):
        raise TimerError(f"scope {name!r} must be a string (a short name such as 'all_reduce')")
    with _lock:
        sid = _sids.get(name)
        if sid is not None:
            return sid
        if len(_names) >= L.UNKNOWN_SCOPE:
            return L.UNKNOWN_SCOPE  # not cached: the dict must not grow without bound
        sid = len(_names)
        _names.append(name)
        _sids[name] = sid
        if _attached is not None:
            _publish(name)
        return sid


def _site_name(frame: Any) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _site_scope(frame: Any) -> int:
    key = (frame.f_code, frame.f_lineno)
    sid = _site_sids.get(key)
    if sid is None:
        sid = _site_sids[key] = scope_id(_site_name(frame))
    return sid


def _publish(name: str) -> None:
    """Append one name to the region's table (caller holds ``_lock``). Bytes first, then the
    length, so the agent never reads an entry that is still being written."""
    global _table_len, _table_full
    if _table_full:
        return
    entry = L.encode_scope(name)
    if _table_len + len(entry) > L.TABLE_SIZE:
        _table_full = True  # later ids would no longer match table positions: stop here
        return
    start = L.TABLE_OFFSET + _table_len
    _buf[start:start + len(entry)] = entry
    _table_len += len(entry)
    L.U64.pack_into(_buf, L.OFF_TABLE_LEN, _table_len)


# -- attaching --------------------------------------------------------------------------------
def attach(regions: str, local_rank: int) -> None:
    """Use region ``local_rank`` of the agent's timer file ``regions`` for this process's timers.

    Normally automatic on first use (from ``ELASTICTK_TIMER_REGIONS`` and ``LOCAL_RANK``).
    Raises :class:`TimerError` naming the problem if the region is missing, from another
    elastictk version, or already claimed by another process.
    """
    with _lock:
        _attach_locked(regions, local_rank)


def _attach_locked(path: str, local_rank: int) -> None:
    global _buf, _free, _attached, _inert_reason, _mmap, _stacks_fd, _table_len, _table_full
    global _region_fd, _wake_fd
    if _attached is not None:
        raise TimerError(f"timers of this process are already attached to {_attached}")
    if len(_free) not in (0, L.SLOTS):
        raise TimerError("cannot attach while timers are held; attach before the first timer")
    region = claim(path, local_rank)
    buf = memoryview(region.mm)
    _wake_fd = region.wake_fd
    _buf, _mmap, _stacks_fd, _region_fd = buf, region.mm, region.stacks_fd, region.fd
    _table_len, _table_full = 0, False
    for name in _names:
        _publish(name)
    L.U32.pack_into(buf, L.OFF_STACKS_FD, region.stacks_fd)
    L.U64.pack_into(buf, L.OFF_MAIN_THREAD, threading.main_thread().ident or 0)
    L.U64.pack_into(buf, L.OFF_OWNER, os.getpid())  # last: the agent may now act on this region
    _attached, _inert_reason = f"{path} region {local_rank}", None
    _free = L.slot_offsets()


def attach_from_env() -> bool:
    """Attach this process's region now rather than on its first timer, so the agent can ask
    it for a stack dump (the progress watchdog does, before it kills a rank that stopped
    making progress) even if it never uses a timer. True if attached; never raises."""
    with _lock:
        if _attached is None and not _free:
            _attach_from_env_locked()
        return _attached is not None


def _attach_from_env_locked() -> None:
    """Attach from the environment, or become inert (with one line on stderr if the agent
    asked for timers but the region cannot be used)."""
    global _free, _inert_reason
    path = os.environ.get(L.ENV_REGIONS)
    if path and path == _forked_env:
        # A fork of a worker that had not used its timers yet (a DataLoader worker): the region
        # is its parent's. A child that is given the variable after fork() (as the agent's
        # fork server does) attaches normally.
        _inert_reason = "this process was forked from the worker that owns the region"
    elif path:
        try:
            _attach_locked(path, int(os.environ.get("ELASTICTK_LOCAL_RANK") or os.environ.get("LOCAL_RANK") or 0))
            # Processes this worker starts must not try to share its region.
            os.environ.pop(L.ENV_REGIONS, None)
            return
        except (TimerError, ValueError) as e:
            _inert_reason = str(e)
            print(f"elastictk.timer: {e}; timers in this process are inert", file=sys.stderr)
    else:
        _inert_reason = f"{L.ENV_REGIONS} is not set (not started by an elastictk agent)"
    _free = L.slot_offsets()


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, ...) must not write its parent's region: it gets
    private, inert slots unless it attaches a region of its own."""
    global _buf, _free, _attached, _inert_reason, _mmap, _stacks_fd, _region_fd, _lock
    global _forked_env, _wake_fd
    _lock = threading.Lock()
    _wake_fd = -1  # inert slots never wake the agent (the fd stays open, as the others)
    _forked_env = os.environ.get(L.ENV_REGIONS)
    was = _attached
    _buf = bytearray(L.REGION_SIZE)
    _free = []
    # The inherited fds stay open (closing them is harmless but pointless); the mapping is unused.
    _attached, _mmap, _stacks_fd, _region_fd = None, None, None, None
    _inert_reason = None
    if was is not None:
        _inert_reason = "forked from a process whose timers were attached"
        _free = L.slot_offsets()


os.register_at_fork(after_in_child=_after_fork_in_child)


def status() -> dict[str, Any]:
    """Plain data about this process's timers, for logs and tests."""
    return {
        "attached": _attached,
        "inert_reason": _inert_reason,
        "held": (L.SLOTS - len(_free)) if (_attached or _inert_reason) else 0,
        "scopes": len(_names),
    }


def detach() -> None:
    """Stop using the region and forget whether the environment named one (only while no timer
    is held): the next timer attaches afresh. For tools that attach explicitly, and tests."""
    global _buf, _free, _attached, _inert_reason, _mmap, _stacks_fd, _region_fd, _wake_fd
    with _lock:
        if _free and len(_free) != L.SLOTS:
            raise TimerError("timers are still held")
        if _wake_fd >= 0:
            os.close(_wake_fd)
            _wake_fd = -1
        if _attached is not None:
            L.U64.pack_into(_buf, L.OFF_OWNER, 0)
            faulthandler.unregister(L.U32.unpack_from(_buf, L.OFF_SIGNAL)[0])
            _buf.release()
            if _mmap is not None:
                _mmap.close()
            for fd in (_stacks_fd, _region_fd):
                if fd is not None:
                    os.close(fd)
        _buf = bytearray(L.REGION_SIZE)
        _free = []
        _attached, _inert_reason, _mmap, _stacks_fd, _region_fd = None, None, None, None, None

"""A flag raised from a signal handler that interrupts the raising of the same flag.

The second SIGTERM of a burst runs its handler on the main thread in the middle of the first
handler's ``set()``. With ``threading.Event`` the nested ``set()`` waits for a lock its own
thread holds: the process hangs (shown here in a child that is killed after its deadline, the
check's red side); :class:`SignalFlag` takes no lock and the child ends at once."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from elastictk.lifetime.sigflag import SignalFlag

# In the child: a trace function sends SIGUSR1 to this process from inside the flag's set(),
# at its second line (inside Event's `with self._cond:`); the handler calls set() again, nested. Exit 0 when both calls return.
NESTED = """
import os, signal, sys, threading
from elastictk.lifetime.sigflag import SignalFlag
flag = threading.Event() if sys.argv[1] == "event" else SignalFlag()
inner = type(flag).set.__code__
fired, lines = [], []
signal.signal(signal.SIGUSR1, lambda *_: (fired.append(1), flag.set()))
def local(frame, event, arg):
    if event == "line" and not fired and len(lines) == 1:  # the 2nd line: Event's lock is held
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs at the next bytecode, in set()
    if event == "line":
        lines.append(frame.f_lineno)
    return local
def trace(frame, event, arg):
    return local if frame.f_code is inner else None
print("setting", flush=True)
sys.settrace(trace)
flag.set()
sys.settrace(None)
assert fired and flag.is_set(), (fired, lines)
print("returned", flush=True)
"""


def _nested(kind: str, deadline: float) -> subprocess.CompletedProcess[str]:
    """The child's run; returncode None when it was still running at ``deadline`` (killed)."""
    proc = subprocess.Popen([sys.executable, "-c", NESTED, kind], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    # One reader of each pipe (communicate() reads the descriptor and would miss what readline()
    # buffered): the first line, then the exit, then the rest; the output is a few lines.
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()  # "setting" (or EOF): the deadline counts from here
    try:
        code: int | None = proc.wait(timeout=deadline)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    out, err = first + proc.stdout.read(), proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    return subprocess.CompletedProcess(proc.args, code, out, err)  # type: ignore[arg-type]


def test_a_nested_set_from_a_signal_handler_returns() -> None:
    done = _nested("flag", 120)
    assert done.returncode == 0 and "returned" in done.stdout, (done.returncode, done.stdout, done.stderr[-2000:])


def test_the_same_nesting_hangs_a_threading_event() -> None:
    """The red side: the hazard the flag exists for is real on this Python."""
    if sys.version_info >= (3, 13):
        pytest.skip("threading.Event's lock may differ on this Python")
    done = _nested("event", 10)
    assert "setting" in done.stdout, f"the child never reached set(): {done.stderr[-2000:]}"
    assert done.returncode is None and "returned" not in done.stdout, \
        "threading.Event survived a nested set(): the test no longer shows the hazard"


def test_wait_wakes_on_set_from_another_thread_and_times_out() -> None:
    flag = SignalFlag()
    try:
        t0 = time.monotonic()
        assert flag.wait(0.05) is False and time.monotonic() - t0 >= 0.05
        threading.Timer(0.1, flag.set).start()
        assert flag.wait(60) is True
        flag.clear()
        assert not flag.is_set() and flag.wait(0) is False  # the wake-up byte was drained too
    finally:
        flag.close()


def test_a_closed_flag_writes_nowhere() -> None:
    flag = SignalFlag()
    r, w = flag._r, flag._w
    flag.close()
    for fd in (r, w):
        with pytest.raises(OSError):
            os.fstat(fd)
    flag.set()  # after close: raises the bool, writes into no (reused) descriptor
    assert flag.is_set() and flag.wait(1) is True


def test_a_signal_handler_wakes_a_waiter_on_the_main_thread() -> None:
    flag = SignalFlag()
    old = signal.signal(signal.SIGUSR1, lambda *_: flag.set())
    try:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        assert flag.wait(60) is True
    finally:
        signal.signal(signal.SIGUSR1, old)
        flag.close()

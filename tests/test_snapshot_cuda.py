"""The local tier's CUDA path (snapshot/cuda.py). Everything that is not a CUDA call runs here on
CPU with stand-ins for ``torch.cuda.cudart()`` and ``torch.cuda`` (a CPU tensor that reports
``is_cuda``); the real calls run in the tests at the end, skipped without a GPU."""
from __future__ import annotations

import threading
from typing import Any, Iterator

import pytest
import torch

from elastictk.snapshot import cuda, worker
from elastictk.snapshot.local import Holder
from elastictk.snapshot.settings import ENV_TIERS, Settings
from elastictk.snapshot.worker import Snapshotter


class FakeCudart:
    def __init__(self, err: int = 0) -> None:
        self.err, self.calls = err, []  # type: ignore[var-annotated]

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        return self.err

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0


def test_a_slot_is_registered_once_and_unregistered_at_close() -> None:
    rt, lines = FakeCudart(), []  # type: ignore[var-annotated]
    buf = bytearray(8192)
    pin = cuda.HostPin(rt, say=lines.append, memory=1 << 20)
    for _ in range(3):
        assert pin.register(0, memoryview(buf)[:4096]) and pin.register(1, memoryview(buf)[4096:])
    assert [c[0] for c in rt.calls] == ["register", "register"], "once per slot"
    assert pin.nbytes == 8192 and rt.calls[1][1] - rt.calls[0][1] == 4096
    pin.close()
    assert rt.calls[2:] == [("unregister", rt.calls[0][1]), ("unregister", rt.calls[1][1])]
    assert lines == [] and pin.nbytes == 0


def test_a_slot_cuda_refuses_falls_back_in_one_line_said_once() -> None:
    rt, lines = FakeCudart(err=2), []  # type: ignore[var-annotated]
    pin = cuda.HostPin(rt, say=lines.append, memory=1 << 20)
    buf = bytearray(4096)
    assert not pin.register(0, memoryview(buf)) and not pin.register(0, memoryview(buf))
    assert len(rt.calls) == 1 and len(lines) == 1
    assert "snapshot slot 0 (4.1 kB of --snapshot-memory 1.0 MB) cannot be page-locked" in lines[0]
    assert "cudaHostRegister error 2" in lines[0] and "ulimit -l" in lines[0]
    pin.close()
    assert len(rt.calls) == 1, "nothing registered, nothing unregistered"


class Ev:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.gate = log, name, threading.Event()
        self.gate.set()

    def record(self, stream: Any = None) -> None:
        self.log.append(f"record {self.name} on {stream}")

    def synchronize(self) -> None:
        self.gate.wait()
        self.log.append(f"host waits {self.name}")


class FakeCuda:
    """torch.cuda's stream and event calls, executed at once on CPU and logged in order."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.events: list[Ev] = []
        self.hold = threading.Event()
        self.hold.set()

    def Stream(self) -> Any:
        log = self.log

        class S:
            def __repr__(self) -> str:
                return "copy"

            def wait_event(self, e: Ev) -> None:
                log.append(f"copy waits {e.name}")
        return S()

    def Event(self) -> Ev:
        e = Ev(self.log, f"e{len(self.events)}")
        e.gate = self.hold
        self.events.append(e)
        return e

    def current_stream(self) -> Any:
        log = self.log

        class S:
            def __repr__(self) -> str:
                return "train"

            def wait_event(self, e: Ev) -> None:
                log.append(f"train waits {e.name}")
        return S()

    def stream(self, s: Any) -> Any:
        import contextlib

        return contextlib.nullcontext()


class OnDevice(torch.Tensor):
    """A CPU tensor the snapshot takes for a CUDA one (its copies are the stand-in's)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


@pytest.fixture
def snap(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Snapshotter, FakeCuda, FakeCudart]]:
    fake, rt = FakeCuda(), FakeCudart()
    real_copy, real_pin = cuda.CopyStream, cuda.HostPin
    monkeypatch.setattr(cuda, "CopyStream", lambda: real_copy(fake))
    monkeypatch.setattr(cuda, "HostPin", lambda **kw: real_pin(rt, **kw))
    with Holder(1, 1 << 22) as h:
        env = {**h.env(), ENV_TIERS: "local"}
        s = Snapshotter(Settings.resolve(env, overlap=True), rank=0, world=1, local_rank=0, local_world=1)
        yield s, fake, rt
        fake.hold.set()  # a failed test may leave the copy "running"
        s.close()
        registered = [c[1] for c in rt.calls if c[0] == "register"]
        assert registered and rt.calls[-len(registered):] == [("unregister", a) for a in registered], rt.calls


def _commit(s: Snapshotter, opt: torch.optim.Optimizer, p: torch.Tensor, step: int) -> None:
    s.gate.attach([opt])
    s.commit({"objects": {"w": p.detach().as_subclass(OnDevice)}, "values": {"step": step}}, step,
             frozenset({p.data_ptr()}))


def test_commit_queues_the_copy_behind_the_training_stream_and_the_step_waits_on_the_stream(
        snap: tuple[Snapshotter, FakeCuda, FakeCudart]) -> None:
    s, fake, _ = snap
    p = torch.nn.Parameter(torch.arange(1000, dtype=torch.float32))
    opt = torch.optim.SGD([p], lr=0.1)
    fake.hold.clear()  # the copy has not finished on the device yet
    _commit(s, opt, p, 1)
    assert fake.log == ["record e0 on train", "copy waits e0", "record e1 on copy"], "commit: no host wait"
    committed = p.detach().clone()
    p.grad = torch.ones_like(p)
    opt.step()  # queued behind the copy: a stream wait, no host wait (the copy is still running)
    assert fake.log[-1] == "train waits e1"
    fake.hold.set()
    s.wait()
    assert "host waits e1" in fake.log, "the background thread waited for the copy"
    step, got = s.last()  # type: ignore[misc]
    assert step == 1 and torch.equal(got["objects"]["w"], committed), "published: the optimizer's own step is no change"


def test_a_tensor_changed_outside_the_optimizer_drops_the_commit(
        snap: tuple[Snapshotter, FakeCuda, FakeCudart], capfd: pytest.CaptureFixture[str]) -> None:
    s, fake, _ = snap
    p = torch.nn.Parameter(torch.arange(1000, dtype=torch.float32))
    opt = torch.optim.SGD([p], lr=0.1)
    _commit(s, opt, p, 1)
    s.wait()
    fake.hold.clear()
    _commit(s, opt, p, 2)
    with torch.no_grad():
        p.clamp_(max=5)  # outside the optimizer, while the copy runs
    p.grad = torch.ones_like(p)
    opt.step()
    fake.hold.set()
    s.wait()
    assert "the snapshot of step 2 is dropped" in capfd.readouterr().err
    assert s.last()[0] == 1  # type: ignore[index]


def test_without_overlap_commit_waits_for_the_copy_itself(monkeypatch: pytest.MonkeyPatch,
                                                           snap: tuple[Snapshotter, FakeCuda, FakeCudart]) -> None:
    s, fake, _ = snap
    s.overlap = False
    p = torch.nn.Parameter(torch.ones(100))
    opt = torch.optim.SGD([p], lr=0.1)
    _commit(s, opt, p, 3)
    assert fake.log[-2:] == ["train waits e1", "host waits e1"]
    assert s.region is not None and s.region.meta(s.region.active).step == 3, "published in commit()"


def test_the_worker_module_names_the_cuda_path() -> None:
    assert worker.cuda is cuda


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_on_a_gpu_a_registered_slot_takes_a_non_blocking_copy_and_restores_host_to_device() -> None:
    from elastictk.snapshot import into
    from elastictk.snapshot.codec import Plan, checksum

    with Holder(1, 64 << 20) as h:
        env = {**h.env(), ENV_TIERS: "local"}
        s = Snapshotter(Settings.resolve(env, overlap=False), rank=0, world=1, local_rank=0, local_world=1)
        t = torch.randn(1 << 20, device="cuda")
        s.commit({"objects": {"w": t}, "values": {}}, 1)
        s.wait()
        assert s._pin is not None and s._pin.nbytes > 0
        assert s.region is not None
        m = s.region.meta(s.region.active)
        dest = torch.zeros_like(t)
        tree, why = into.load_verified(s.region.data(m.index)[:m.length], m.digest,
                                       {"objects": {"w": dest}, "values": {}})
        assert why is None and tree["objects"]["w"] is not None and torch.equal(dest, t)
        assert checksum(s.region.data(m.index)[:m.length]) == m.digest
        assert Plan({"w": t}).size <= m.length
        s.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_the_cuda_benchmark_without_cuda_is_one_line_and_exit_2() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-m", "bench", "snapshot", "--device", "cuda"], cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "", p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith(
        "python -m bench snapshot --device cuda: CUDA is absent here"), p.stderr


def test_the_numa_shim_refuses_bad_arguments_and_a_failed_binding_in_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    from elastictk.supervisor import numabind

    assert numabind.main(["nowhere", "--", "true"]) == 2
    assert "usage: MODE -- COMMAND" in capsys.readouterr().err
    if not torch.cuda.is_available():  # torch's binding cannot find a GPU here: one line, exit 1
        assert numabind.main(["node", "--", "true"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--numa-binding node: cannot bind local rank 0" in err

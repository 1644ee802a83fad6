"""A training state (nested dicts and lists of tensors and plain values) as one flat buffer.

Layout: ``u64 skeleton length | skeleton | padding to 64 | tensor bytes, each 64-aligned``.
The skeleton is the state with every tensor replaced by ``{"__etk_tensor__": i}``, plus each
tensor's dtype, shape and offset, written with ``torch.save`` and read back with
``weights_only=True`` (plain data only, no code). Tensors are copied straight from where they
live into the buffer (one copy; a GPU tensor goes device to host once), and read back as views
or clones.

:func:`checksum` is what both tiers store and verify: XXH3-64, which reads memory at about four
times zlib's CRC-32 speed, so verifying a part before a restore costs little next to copying it.
"""
from __future__ import annotations

import io
import struct
from collections import OrderedDict
from typing import Any

ALIGN = 64
MARK = "__etk_tensor__"
U64 = struct.Struct("<Q")


def checksum(data: Any) -> int:
    """XXH3-64 of a buffer (bytes, bytearray, memoryview, mmap), read in place, no copy."""
    import xxhash

    return int(xxhash.xxh3_64_intdigest(data))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Plan:
    """Where every tensor of one state goes; ``size`` bytes in all."""

    def __init__(self, state: Any) -> None:
        import torch

        self.tensors: list[Any] = []
        meta: list[tuple[str, list[int], int, int]] = []
        offset = 0

        def strip(x: Any) -> Any:
            nonlocal offset
            if isinstance(x, torch.Tensor):
                nbytes = x.numel() * x.element_size()
                meta.append((str(x.dtype).removeprefix("torch."), list(x.shape), offset, nbytes))
                self.tensors.append(x.detach())
                offset = _align(offset + nbytes)
                return {MARK: len(self.tensors) - 1}
            if isinstance(x, dict):
                out = OrderedDict() if isinstance(x, OrderedDict) else {}
                for k, v in x.items():
                    out[k] = strip(v)
                return out
            if isinstance(x, (list, tuple)):
                seq = [strip(v) for v in x]
                return seq if isinstance(x, list) else tuple(seq)
            return x

        tree = strip(state)
        buf = io.BytesIO()
        torch.save({"tree": tree, "tensors": meta}, buf)
        self.skeleton = buf.getvalue()
        self.base = _align(U64.size + len(self.skeleton))
        self.meta = meta
        self.size = self.base + offset

    def write(self, out: memoryview, skip: frozenset[int] = frozenset()) -> None:
        """Serialize into ``out`` (at least ``size`` bytes), but the tensors whose indices are
        in ``skip`` (:meth:`write_tensors` copies those later: a pipelined commit)."""
        U64.pack_into(out, 0, len(self.skeleton))
        out[U64.size:U64.size + len(self.skeleton)] = self.skeleton
        self.write_tensors(out, [i for i in range(len(self.tensors)) if i not in skip])

    def pairs(self, out: memoryview, indices: list[int]) -> list[tuple[Any, Any]]:
        """``(where in out, tensor)`` for each of ``indices`` (the CUDA path queues these copies
        on a stream of its own; ``out`` must outlive them)."""
        import torch

        u8 = torch.frombuffer(out, dtype=torch.uint8, count=self.size)
        got = []
        for i in indices:
            t, (_, shape, off, nbytes) = self.tensors[i], self.meta[i]
            if nbytes:
                got.append((u8[self.base + off:self.base + off + nbytes].view(t.dtype).view(shape), t))
        return got

    def write_tensors(self, out: memoryview, indices: list[int]) -> None:
        import torch

        if not indices:
            return
        u8 = torch.frombuffer(out, dtype=torch.uint8, count=self.size)
        try:
            for i in indices:
                t, (_, shape, off, nbytes) = self.tensors[i], self.meta[i]
                if nbytes:
                    start = self.base + off
                    u8[start:start + nbytes].view(t.dtype).view(shape).copy_(t)
        finally:
            del u8


def read(data: memoryview, *, clone: bool = True) -> Any:
    """The state serialized at the start of ``data``. ``clone=False`` returns tensors that are
    views of ``data`` (the caller copies them out before ``data`` changes)."""
    import torch

    (n,) = U64.unpack_from(data, 0)
    skel = torch.load(io.BytesIO(bytes(data[U64.size:U64.size + n])), weights_only=True)
    base = _align(U64.size + n)
    u8 = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    tensors = []
    for dtype_name, shape, off, nbytes in skel["tensors"]:
        dtype = getattr(torch, dtype_name)
        if nbytes:
            t = u8[base + off:base + off + nbytes].view(dtype).view(shape)
            tensors.append(t.clone() if clone else t)
        else:
            tensors.append(torch.empty(shape, dtype=dtype))

    def build(x: Any) -> Any:
        if isinstance(x, dict):
            if len(x) == 1 and MARK in x:
                return tensors[x[MARK]]
            out = OrderedDict() if isinstance(x, OrderedDict) else {}
            for k, v in x.items():
                out[k] = build(v)
            return out
        if isinstance(x, list):
            return [build(v) for v in x]
        if isinstance(x, tuple):
            return tuple(build(v) for v in x)
        return x

    return build(skel["tree"])


def used_size(data: memoryview) -> int:
    """How many bytes of ``data`` a serialized state occupies (for checks before reading)."""
    import torch

    (n,) = U64.unpack_from(data, 0)
    skel = torch.load(io.BytesIO(bytes(data[U64.size:U64.size + n])), weights_only=True)
    end = max((off + nb for _, _, off, nb in skel["tensors"]), default=0)
    return _align(U64.size + n) + end

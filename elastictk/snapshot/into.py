"""Restore in place: a serialized state copied into the tensors the script already has.

A restarted worker has built its model (parameters allocated and initialized) and, for a
resumed optimizer, often its state too; allocating a fresh tensor per entry and copying again in
``load_state_dict`` costs a page fault per 4 kB page twice over. So the restore walks the
snapshot and the current ``state_dict()``s side by side: where the script holds a plain,
contiguous tensor of the same shape and dtype at the same place, the snapshot's bytes are copied
straight into it (a module's parameters, an optimizer's moments); only what the script does not
hold yet (a fresh optimizer's momentum) is allocated, once.

CUDA tensors the script holds are destinations too: each chunk goes host to device with
``non_blocking=True`` from the slot (page-locked by :mod:`.cuda` when it could be registered),
and the stream is synchronized once at the end.

The copy from the local tier goes in chunks of :data:`CHUNK` bytes in the slot's order, and a
second thread checksums (XXH3-64, streamed: the same digest as one pass) each chunk while the
next is copied, so verifying costs little more than copying; the verdict comes at the end
(:func:`load_verified` says why the part is torn, and the caller then restores another step over
what was copied, or stops the worker).
"""
from __future__ import annotations

import io
import queue
import threading
from typing import Any, Callable, Optional

from . import codec

CHUNK = 16 << 20  # small enough that the checksum reads a chunk the copy just brought in


def _plain(t: Any) -> bool:
    import torch

    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_contiguous()


_NOT_LEAF = object()


def _beside(x: Any, cur: Any, leaf: Callable[[Any, Any], Any]) -> Any:
    """``x`` rebuilt, walking ``cur`` (the state's tensors now) beside it: ``leaf(x, cur)`` for
    each node it takes (anything but ``_NOT_LEAF``), dicts, lists and tuples rebuilt around
    them, the rest kept. The one walk a restore in place and a peer's part both need."""
    got = leaf(x, cur)
    if got is not _NOT_LEAF:
        return got
    if isinstance(x, dict):
        same = cur if isinstance(cur, dict) else {}
        built = type(x)() if type(x) is not dict else {}
        for k, v in x.items():
            built[k] = _beside(v, same.get(k), leaf)
        return built
    if isinstance(x, (list, tuple)):
        seq = cur if isinstance(cur, (list, tuple)) and len(cur) == len(x) else [None] * len(x)
        items = [_beside(v, c, leaf) for v, c in zip(x, seq)]
        return items if isinstance(x, list) else tuple(items)
    return x


def destinations(tree: Any, current: Any, meta: list[tuple[str, list[int], int, int]]) -> tuple[Any, list[Any]]:
    """``tree`` (a skeleton: ``{MARK: i}`` leaves) with each tensor leaf replaced by where it
    goes: the tensor at the same place in ``current`` when it is a plain tensor of the same
    shape and dtype, else a new one; and that list of tensors by index."""
    import torch

    out: list[Any] = [None] * len(meta)

    def leaf(x: Any, cur: Any) -> Any:
        if not (isinstance(x, dict) and len(x) == 1 and codec.MARK in x):
            return _NOT_LEAF
        i = x[codec.MARK]
        dtype_name, shape, _, _ = meta[i]
        dtype = getattr(torch, dtype_name)
        if isinstance(cur, torch.Tensor) and _plain(cur) and cur.dtype == dtype \
                and list(cur.shape) == list(shape) and cur.device.type in ("cpu", "cuda"):
            out[i] = cur.detach()
        else:
            out[i] = torch.empty(shape, dtype=dtype)
        return out[i]

    built = _beside(tree, current, leaf)
    for i, t in enumerate(out):  # bytes the tree does not name are still read (the checksum covers them)
        if t is None:
            out[i] = torch.empty(meta[i][1], dtype=getattr(torch, meta[i][0]))
    return built, out


class Unreadable(ValueError):
    """The part's skeleton does not parse or its tensors do not fit the part: torn."""


def _skeleton(data: memoryview) -> tuple[Any, list[tuple[str, list[int], int, int]], int]:
    """The tree and the tensors' (dtype, shape, offset, bytes), each checked against the part:
    the checksum is known only once every byte was read, so nothing here may trust them."""
    import torch

    try:
        (n,) = codec.U64.unpack_from(data, 0)
        if n > len(data) - codec.U64.size:
            raise Unreadable(f"a skeleton of {n} bytes in a part of {len(data)}")
        skel = torch.load(io.BytesIO(bytes(data[codec.U64.size:codec.U64.size + n])), weights_only=True)
        tree, meta = skel["tree"], skel["tensors"]
    except Unreadable:
        raise
    except Exception as e:  # whatever torch.load or the lookups raise on garbage
        raise Unreadable(f"the skeleton does not parse: {type(e).__name__}") from None
    base = (codec.U64.size + n + codec.ALIGN - 1) // codec.ALIGN * codec.ALIGN
    if not isinstance(meta, list):
        raise Unreadable("the skeleton's tensor list is not a list")
    for entry in meta:
        try:
            dtype_name, shape, off, nbytes = entry
            dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
            numel = 1
            for d in shape:
                numel *= int(d) if isinstance(d, int) and d >= 0 else -1
            ok = (isinstance(dtype, torch.dtype) and isinstance(off, int) and isinstance(nbytes, int)
                  and numel >= 0 and nbytes == numel * dtype.itemsize and 0 <= off
                  and base + off + nbytes <= len(data))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise Unreadable(f"a tensor entry {str(entry)[:80]} does not fit a part of {len(data)} bytes")
    return tree, meta, base


def _pieces(meta: list[tuple[str, list[int], int, int]], base: int, start: int, end: int
            ) -> list[tuple[int, int, int]]:
    """(tensor index, first byte in the tensor, byte count) of what lies in ``[start, end)``."""
    got = []
    for i, (_, _, off, nbytes) in enumerate(meta):
        lo, hi = max(start, base + off), min(end, base + off + nbytes)
        if lo < hi:
            got.append((i, lo - base - off, hi - lo))
    return got


def load_verified(data: memoryview, digest: int, current: Any,
                  copy: Optional[Callable[[Any, Any], None]] = None) -> tuple[Any, Optional[str]]:
    """The state in ``data`` (a slot's bytes, exactly its length) copied into ``current``'s
    tensors where they fit, checksummed chunk by chunk on a second thread while the next chunk
    is copied; ``(tree, None)``, or ``(tree, why)`` when the bytes do not match ``digest`` (the
    tensors then hold torn bytes: the caller restores something else over them)."""
    import torch
    import xxhash

    try:
        tree, meta, base = _skeleton(data)
        built, dest = destinations(tree, current, meta)
    except (Unreadable, RecursionError, IndexError, KeyError, TypeError) as e:
        return None, f"unreadable: {type(e).__name__}: {str(e)[:120]}"
    flat = [t.reshape(-1).view(torch.uint8) if t.numel() else None for t in dest]
    u8 = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    h = xxhash.xxh3_64()
    todo: "queue.Queue[Optional[tuple[int, int]]]" = queue.Queue(maxsize=2)

    def hash_chunks() -> None:
        while (r := todo.get()) is not None:
            h.update(data[r[0]:r[1]])

    hasher = threading.Thread(target=hash_chunks, name="elastictk-restore-sum", daemon=True)
    hasher.start()
    try:
        for start in range(0, len(data), CHUNK):
            end = min(start + CHUNK, len(data))
            for i, at, n in _pieces(meta, base, start, end):
                whole = flat[i]
                assert whole is not None  # _pieces skips empty tensors
                dst, src = whole[at:at + n], u8[base + meta[i][2] + at:base + meta[i][2] + at + n]
                if copy is not None:
                    copy(dst, src)
                else:  # host to device from a page-locked slot: queued, not waited for
                    dst.copy_(src, non_blocking=dst.is_cuda)
            todo.put((start, end))
    finally:
        todo.put(None)
        hasher.join()
        if any(t.is_cuda for t in dest):
            torch.cuda.current_stream().synchronize()  # the slot may change once this returns
        del u8
    got = h.intdigest()
    why = None if got == digest else f"checksum {got:016x} != {digest:016x}"
    return built, why


def copy_tree(tree: Any, current: Any) -> Any:
    """``tree`` (tensors that are views of memory about to change, e.g. a part received over the
    process group) with every tensor copied into ``current``'s where it fits, else cloned."""
    import torch

    def leaf(x: Any, cur: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return _NOT_LEAF
        if isinstance(cur, torch.Tensor) and _plain(cur) and cur.dtype == x.dtype \
                and cur.shape == x.shape and cur.device == x.device:
            return cur.detach().copy_(x)
        return x.clone()

    return _beside(tree, current, leaf)

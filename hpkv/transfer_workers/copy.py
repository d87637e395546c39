"""Batched block copies between a device KV cache and the DRAM pool (native/copy.c).

A device's KV cache is described once, at registration, by a :class:`BlockLayout`:
block ``b`` of layer ``l`` is the ``page_bytes`` bytes at
``layer_bases[l] + b * block_stride``. A pool slot holds every layer of one block back
to back (layer ``l`` at ``l * page_bytes``), so one slot is ``slot_bytes`` long.
:class:`BlockCopier` then moves a whole batch of (block, slot) pairs in one native
call, with the GIL released, after validating every id (an error copies nothing).

Addresses are absolute in this process. The layout and copier keep references to
the arrays/tensors/buffers they were built from so the memory outlives them; when
built from bare integer addresses, keeping the mapping alive is the caller's job.
"""

from __future__ import annotations

import functools
import itertools
import mmap
import os
import threading
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpkv.common.layout import pages_fit, pages_span
from hpkv.common.native import ffi, lib

__all__ = [
    "BlockLayout",
    "BlockCopier",
    "BlockIndexError",
    "SAVE",
    "LOAD",
    "set_nt_threshold",
]

SAVE: int = lib.HPKV_SAVE  # device -> pool
LOAD: int = lib.HPKV_LOAD  # pool -> device

_U64_LIMIT = 1 << 64
#: A batch smaller than this is copied by one thread: the hand-off costs more than it saves.
SPLIT_MIN_BYTES = 8 << 20
#: A split batch is cut into this many chunks per thread, taken in turn: a thread that shares
#: its CPU with a busy engine thread copies fewer of them.
CHUNKS_PER_THREAD = 4


class BlockIndexError(IndexError):
    """A block or slot id in a batch is out of range; nothing of the batch was copied."""

    def __init__(self, message: str, *, which: str, position: int, value: int, limit: int):
        super().__init__(message)
        self.which = which  # "dev_blocks" or "slots"
        self.position = position  # index into the batch
        self.value = value  # the offending id
        self.limit = limit  # ids must be in [0, limit)


def _is_torch_tensor(obj: Any) -> bool:
    # Duck-typed so that this module never imports torch (the connector imports cheaply).
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _memory_of(obj: Any, what: str, *, writable: bool = True) -> tuple[int, int | None, Any]:
    """(address, size in bytes or None when unknown, object to keep alive) of an int
    address, numpy array, CPU torch tensor, or writable buffer (mmap, bytearray,
    memoryview). For buffers the keep-alive object is a view holding a buffer export,
    so an mmap cannot be closed (unmapped) under a copier that still points into it."""
    if isinstance(obj, (int, np.integer)) and not isinstance(obj, bool):
        addr = int(obj)
        if not 0 < addr < _U64_LIMIT:
            raise ValueError(f"{what}: address {addr:#x} is not a valid pointer")
        return addr, None, None
    if _is_torch_tensor(obj):
        if obj.device.type != "cpu":
            raise ValueError(
                f"{what}: tensor is on {obj.device}; this copier moves host memory only "
                "(CUDA KV caches go through the CUDA transfer path)"
            )
        if not obj.is_contiguous():
            raise ValueError(f"{what}: tensor must be contiguous (got strides {tuple(obj.stride())})")
        return obj.data_ptr(), obj.numel() * obj.element_size(), obj
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(f"{what}: array must be C-contiguous (got strides {obj.strides})")
        if writable and not obj.flags.writeable:
            raise ValueError(f"{what}: array is read-only; copies write into it")
        return obj.__array_interface__["data"][0], obj.nbytes, obj
    if isinstance(obj, (mmap.mmap, bytes, bytearray, memoryview)):
        arr = np.frombuffer(obj, dtype=np.uint8)  # read-only buffers give a read-only view
        if writable and not arr.flags.writeable:
            raise ValueError(f"{what}: buffer is read-only; copies write into it")
        return arr.__array_interface__["data"][0], arr.nbytes, arr
    raise TypeError(
        f"{what}: expected an int address, a numpy array, a CPU torch tensor or a "
        f"writable buffer, got {type(obj).__name__}"
    )


def _block_geometry(t: Any, i: int) -> tuple[int, int, int, int]:
    """(address, num_blocks, block_stride, page_bytes) of one per-layer KV tensor whose
    dim 0 is the block. Each block must cover a dense byte range (its inner dims may be
    permuted, e.g. vLLM's NHD/HND views: pages are opaque bytes)."""
    what = f"tensors[{i}]"
    if _is_torch_tensor(t):
        if t.device.type != "cpu":
            raise ValueError(
                f"{what} is on {t.device}; this copier moves host memory only "
                "(CUDA KV caches go through the CUDA transfer path)"
            )
        addr, shape, itemsize = t.data_ptr(), tuple(t.shape), t.element_size()
        strides = tuple(s * itemsize for s in t.stride())
    elif isinstance(t, np.ndarray):
        if not t.flags.writeable:
            raise ValueError(f"{what} is read-only; loads write into the KV cache")
        addr, shape, itemsize, strides = t.__array_interface__["data"][0], t.shape, t.itemsize, t.strides
    else:
        raise TypeError(f"{what}: expected a numpy array or a CPU torch tensor, got {type(t).__name__}")
    if len(shape) < 1 or shape[0] < 1:
        raise ValueError(f"{what}: needs a leading block dimension of at least 1, got shape {shape}")
    page = itemsize
    for size, stride in sorted(
        ((s, st) for s, st in zip(shape[1:], strides[1:], strict=False) if s != 1), key=lambda p: p[1]
    ):
        if stride != page:
            raise ValueError(
                f"{what}: a block is not one dense byte range (shape {shape}, byte strides "
                f"{strides}); pass a view whose dims after the first are a permutation of "
                "a contiguous layout"
            )
        page *= size
    block_stride = strides[0] if shape[0] > 1 else page
    if block_stride < page:
        raise ValueError(
            f"{what}: block stride {block_stride} B is smaller than the {page} B page "
            f"(shape {shape}, byte strides {strides}); blocks would overlap"
        )
    return addr, shape[0], block_stride, page


@dataclass(frozen=True)
class BlockLayout:
    """Where every (block, layer) page of one device's KV cache lives.

    Page of block ``b`` in layer ``l``: ``layer_bases[l] + b * block_stride``, ``page_bytes`` long.
    """

    layer_bases: tuple[int, ...]
    block_stride: int
    page_bytes: int
    num_blocks: int
    # What owns the memory (arrays, tensors, mappings): kept alive with the layout.
    owners: tuple[Any, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        bases = tuple(int(b) for b in self.layer_bases)
        object.__setattr__(self, "layer_bases", bases)
        object.__setattr__(self, "owners", tuple(self.owners))
        if not bases:
            raise ValueError("BlockLayout needs at least one layer (layer_bases is empty)")
        if self.page_bytes <= 0:
            raise ValueError(f"page_bytes must be > 0, got {self.page_bytes}")
        if self.block_stride < self.page_bytes:
            raise ValueError(
                f"block_stride ({self.block_stride}) must be >= page_bytes ({self.page_bytes}); "
                "consecutive blocks of a layer would overlap"
            )
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {self.num_blocks}")
        for i, b in enumerate(bases):
            if b <= 0 or not pages_fit(b, _U64_LIMIT, self.num_blocks, self.block_stride, self.page_bytes):
                raise ValueError(
                    f"layer_bases[{i}] = {b:#x} is not a valid address for {self.num_blocks} "
                    f"blocks of stride {self.block_stride}"
                )

    @property
    def num_layers(self) -> int:
        return len(self.layer_bases)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one pool slot: every layer's page of one block."""
        return self.num_layers * self.page_bytes

    @classmethod
    def from_tensors(cls, tensors: Sequence[Any]) -> BlockLayout:
        """One region per layer (vLLM CPU/CUDA LBHNC/LBNHC): one numpy array or CPU torch
        tensor per layer, block dimension first, e.g. ``[num_blocks, heads, block, 2*head]``
        (strides may pad blocks). All layers must agree on block count, stride and page."""
        tensors = list(tensors)
        if not tensors:
            raise ValueError("from_tensors needs one tensor per layer, got none")
        geo = [_block_geometry(t, i) for i, t in enumerate(tensors)]
        _, nb0, bs0, pg0 = geo[0]
        for i, (_, nb, bs, pg) in enumerate(geo[1:], 1):
            if (nb, bs, pg) != (nb0, bs0, pg0):
                raise ValueError(
                    f"tensors[{i}] has {nb} blocks of stride {bs} B and page {pg} B, but "
                    f"tensors[0] has {nb0} blocks of stride {bs0} B and page {pg0} B; every "
                    "layer of one layout must have the same geometry (register differing "
                    "cache groups as separate layouts)"
                )
        return cls(tuple(g[0] for g in geo), bs0, pg0, nb0, owners=tuple(tensors))

    @classmethod
    def block_outermost(
        cls,
        base: Any,
        num_layers: int,
        num_blocks: int,
        page_bytes: int,
        *,
        block_stride: int | None = None,
    ) -> BlockLayout:
        """A single region where each block holds all layers' pages back to back
        (vLLM BLHNC/BLNHC cross-layer blocks). ``base``: an address, numpy array, CPU
        torch tensor or buffer; ``block_stride`` defaults to ``num_layers * page_bytes``."""
        if num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {num_layers}")
        if block_stride is None:
            block_stride = num_layers * page_bytes
        if block_stride < num_layers * page_bytes:
            raise ValueError(
                f"block_stride ({block_stride}) must be >= num_layers*page_bytes "
                f"({num_layers}*{page_bytes}); blocks would overlap"
            )
        addr, size, owner = _memory_of(base, "base")
        need = pages_span(num_blocks, block_stride, num_layers * page_bytes)
        if size is not None and size < need:
            raise ValueError(
                f"base holds {size} B but {num_blocks} blocks of stride {block_stride} need {need} B"
            )
        owners = () if owner is None else (owner,)
        return cls(
            tuple(addr + ly * page_bytes for ly in range(num_layers)),
            block_stride,
            page_bytes,
            num_blocks,
            owners=owners,
        )


_NDARRAY = np.ndarray
_I64 = np.dtype(np.int64)


def _index_array(x: Any, what: str) -> np.ndarray:
    """A C-contiguous 1-D int64 array of the ids in ``x`` (converted only when needed)."""
    a = np.asarray(x)
    if a.size == 0:
        return np.empty(0, np.int64)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise TypeError(f"{what} must be a 1-D sequence of integers, got {a.dtype} with shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.int64)


class BlockCopier:
    """Copies batches of device blocks to/from pool slots (one native call per batch).

    ``pool``: the address of slot 0 (int) or the object that owns the pool mapping
    (mmap, numpy array, CPU torch tensor); slot ``s`` is at ``pool + s * slot_stride``.
    Safe to call from several threads at once (the GIL is released during the copy).

    ``thread_cpus``: the CPUs of each copy thread, disjoint sets. Helper ``k`` of a split
    copy runs on ``thread_cpus[k + 1]``; the caller pins its own thread to ``thread_cpus[0]``.
    Without it the scheduler places the threads, and next to a process that busy-polls with
    sched_yield (vLLM's engine while it waits for a copy) it stacks both of a 2-CPU machine's
    copy threads on one CPU: the split copy then takes as long as one thread's.
    """

    def __init__(
        self,
        layout: BlockLayout,
        pool: Any,
        slot_stride: int,
        num_slots: int,
        thread_cpus: Sequence[Collection[int]] = (),
    ):
        if slot_stride < layout.slot_bytes:
            raise ValueError(
                f"slot_stride ({slot_stride}) is smaller than one block of all layers "
                f"({layout.num_layers} layers x {layout.page_bytes} B = {layout.slot_bytes} B)"
            )
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        addr, size, owner = _memory_of(pool, "pool")
        need = (num_slots - 1) * slot_stride + layout.slot_bytes
        if size is not None and size < need:
            raise ValueError(
                f"pool holds {size} B but {num_slots} slots of stride {slot_stride} need {need} B"
            )
        self.layout = layout
        self.pool_address = addr
        self.slot_stride = int(slot_stride)
        self.num_slots = int(num_slots)
        self._pool_owner = owner  # keeps the pool memory (and an mmap's export) alive
        # Built once: the C layout, its base array, the pool pointer, bound functions.
        self._c_bases = ffi.new("uint64_t[]", list(layout.layer_bases))
        self._c_layout = ffi.new(
            "hpkv_layout *",
            {
                "layer_base": self._c_bases,
                "num_layers": layout.num_layers,
                "num_blocks": layout.num_blocks,
                "block_stride": layout.block_stride,
                "page_bytes": layout.page_bytes,
            },
        )
        self._c_pool = ffi.cast("uint8_t *", addr)
        self._copy = lib.hpkv_copy_blocks
        self._from_buffer = ffi.from_buffer
        self._helper_executor: ThreadPoolExecutor | None = None  # split copies, made on first use
        self._helper_threads = 0
        self._helper_lock = threading.Lock()
        self._thread_cpus = [set(c) for c in thread_cpus]

    def save(self, dev_blocks: Any, slots: Any, threads: int = 1) -> None:
        """Device blocks ``dev_blocks[i]`` -> pool slots ``slots[i]``; split like :meth:`load`."""
        self._split(dev_blocks, slots, SAVE, threads)

    def load(self, dev_blocks: Any, slots: Any, threads: int = 1) -> None:
        """Pool slots ``slots[i]`` -> device blocks ``dev_blocks[i]``; a batch of at least
        :data:`SPLIT_MIN_BYTES` is split over up to ``threads`` threads (the engine waits for
        the copy: its cores are free). Every id is checked before anything is copied."""
        self._split(dev_blocks, slots, LOAD, threads)

    def _split(self, dev_blocks: Any, slots: Any, direction: int, threads: int) -> None:
        n = len(dev_blocks)
        parts = min(threads, n * self.layout.slot_bytes // SPLIT_MIN_BYTES, n)
        if parts <= 1:
            self._run(dev_blocks, slots, direction)
            return
        b, s = _index_array(dev_blocks, "dev_blocks"), _index_array(slots, "slots")
        self._check(b, s)
        chunks = min(n, parts * CHUNKS_PER_THREAD)
        bounds = [n * i // chunks for i in range(chunks + 1)]
        taken = itertools.count()  # next() is atomic under the GIL

        def copy_chunks() -> None:
            while (i := next(taken)) < chunks:
                self._run(b[bounds[i] : bounds[i + 1]], s[bounds[i] : bounds[i + 1]], direction)

        with self._helper_lock:  # never submit to a pool another caller is replacing
            helpers = self._helpers(parts - 1)
            rest = [helpers.submit(copy_chunks) for _ in range(parts - 1)]
        try:
            copy_chunks()
        finally:
            wait(rest)  # never return while a helper still writes the KV cache or the pool
        for f in rest:
            f.result()

    def _helpers(self, n: int) -> ThreadPoolExecutor:
        if self._helper_threads < n:
            if self._helper_executor is not None:
                self._helper_executor.shutdown(wait=False)
            self._helper_executor = ThreadPoolExecutor(
                n,
                thread_name_prefix="hpkv-copy",
                initializer=functools.partial(self._pin_helper, itertools.count(1)),
            )
            self._helper_threads = n
        assert self._helper_executor is not None
        return self._helper_executor

    def _pin_helper(self, helper_numbers: Iterator[int]) -> None:
        """A new helper thread takes the next CPU set (helper k: ``thread_cpus[k]``)."""
        if not self._thread_cpus:
            return
        cpus = self._thread_cpus[next(helper_numbers) % len(self._thread_cpus)]
        try:
            os.sched_setaffinity(0, cpus)  # this thread
        except OSError:  # a CPU went offline or the cgroup shrank
            # Not the CPUs of the thread that started it (the caller's set): all of them.
            try:
                os.sched_setaffinity(0, set().union(*self._thread_cpus))
            except OSError:
                pass

    def _check(self, b: np.ndarray, s: np.ndarray) -> None:
        """Raise the error the native copy would for the first bad pair."""
        if len(b) != len(s):
            raise ValueError(f"dev_blocks has {len(b)} ids but slots has {len(s)}; they pair up one to one")
        bad = (b < 0) | (b >= self.layout.num_blocks) | (s < 0) | (s >= self.num_slots)
        if bad.any():
            pos = int(np.argmax(bad))
            kind = lib.HPKV_COPY_EBLOCK if not 0 <= b[pos] < self.layout.num_blocks else lib.HPKV_COPY_ESLOT
            self._raise(-(pos * lib.HPKV_COPY_ERR_STRIDE - kind), b, s)

    def _run(self, dev_blocks: Any, slots: Any, direction: int) -> None:
        # Hot path: int64 1-D arrays go straight to from_buffer, which also rejects
        # non-contiguous arrays (then converted below). ~1.5 us per call in all.
        b, s = dev_blocks, slots
        if not (type(b) is _NDARRAY and b.dtype is _I64 and b.ndim == 1):
            b = _index_array(b, "dev_blocks")
        if not (type(s) is _NDARRAY and s.dtype is _I64 and s.ndim == 1):
            s = _index_array(s, "slots")
        fb = self._from_buffer
        try:
            cb, cs = fb("int64_t[]", b), fb("int64_t[]", s)
        except (ValueError, BufferError):  # a strided view
            b, s = np.ascontiguousarray(b), np.ascontiguousarray(s)
            cb, cs = fb("int64_t[]", b), fb("int64_t[]", s)
        n = len(cb)
        if len(cs) != n:
            raise ValueError(f"dev_blocks has {n} ids but slots has {len(cs)}; they pair up one to one")
        if n == 0:
            return
        rc = self._copy(self._c_layout, self._c_pool, self.slot_stride, self.num_slots, cb, cs, n, direction)
        if rc:
            self._raise(rc, b, s)

    def _raise(self, rc: int, b: np.ndarray, s: np.ndarray) -> None:
        if rc == lib.HPKV_COPY_EARG:  # the constructor validated everything the C checks
            raise RuntimeError("hpkv_copy_blocks rejected its arguments (EARG); this is a bug")
        pos, kind = (-rc) // lib.HPKV_COPY_ERR_STRIDE, -((-rc) % lib.HPKV_COPY_ERR_STRIDE)
        if kind == lib.HPKV_COPY_EBLOCK:
            which, value, limit, what = "dev_blocks", int(b[pos]), self.layout.num_blocks, "KV-cache block"
        else:
            which, value, limit, what = "slots", int(s[pos]), self.num_slots, "pool slot"
        raise BlockIndexError(
            f"{which}[{pos}] = {value} is not a valid {what} id (valid: 0..{limit - 1}); "
            "nothing of this batch was copied",
            which=which,
            position=pos,
            value=value,
            limit=limit,
        )


def set_nt_threshold(nbytes: int) -> int:
    """Batches of at least ``nbytes`` use streaming stores (default 1 MiB). Returns the
    previous value. For tuning and benchmarks; process-wide."""
    return int(lib.hpkv_copy_set_nt_threshold(int(nbytes)))

"""Block copies between a CUDA KV cache and the pinned DRAM pool (native/cuda_copy.c), shared by
the transfer worker and the connector's in-process mode.

The copy of a batch is planned on the host (:meth:`CudaCopier.plan`: validated, one descriptor
per contiguous run, the same bytes the CPU path's ``hpkv_copy_blocks`` moves) and executed by
a :class:`Driver`: :class:`CudaDriver` issues one ``cuMemcpyBatchAsync`` on a stream (a loop of
``cuMemcpyAsync`` on drivers before 12.8); :class:`HostDriver` runs the same descriptors with
memcpy, so the whole path runs in CI on host memory. The driver is the only thing the host
mode replaces.

The device side of the layout is relative to one allocation (``dev_base``, ``dev_bytes``): the
engine's KV buffer as imported over CUDA IPC, or a host buffer for :class:`HostDriver`. Every
plan is checked against it before a descriptor is issued.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hpkv.common.cuda import CudaError, CudaUnavailable, cuda_unavailable_reason
from hpkv.common.layout import pages_fit
from hpkv.common.native import ffi, lib

__all__ = [
    "CopyIndexError",
    "CudaError",
    "CudaUnavailable",
    "Driver",
    "CudaDriver",
    "HostDriver",
    "DeviceLayout",
    "CudaCopier",
    "cuda_unavailable_reason",
    "SAVE",
    "LOAD",
]

SAVE: int = lib.HPKV_SAVE  # device -> pool
LOAD: int = lib.HPKV_LOAD  # pool -> device


class CopyIndexError(IndexError):
    """A block or slot id of a batch is out of range; nothing of the batch was issued."""

    def __init__(self, message: str, *, which: str, position: int, value: int, limit: int):
        super().__init__(message)
        self.which, self.position, self.value, self.limit = which, position, value, limit


#: Host registration is done in chunks: one call of >= 512 GiB fails on r580+ drivers, and
#: vLLM bounds its own calls at 64 GiB ("to avoid driver limits").
HOST_REGISTER_CHUNK = 64 << 30


def _check(rc: int, what: str) -> None:
    if rc:
        raise CudaError(what, rc)


@dataclass(frozen=True)
class DeviceLayout:
    """Pages of one engine's KV cache, relative to its allocation: page of block ``b`` in layer
    ``l`` at ``dev_base + layer_offsets[l] + b * block_stride``, ``page_bytes`` long."""

    dev_base: int
    dev_bytes: int
    layer_offsets: tuple[int, ...]
    block_stride: int
    page_bytes: int
    num_blocks: int

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.page_bytes <= 0 or self.block_stride < self.page_bytes:
            raise ValueError(
                f"bad device layout: {self.num_blocks} blocks, stride {self.block_stride}, page {self.page_bytes}"
            )
        for i, off in enumerate(self.layer_offsets):
            if not pages_fit(off, self.dev_bytes, self.num_blocks, self.block_stride, self.page_bytes):
                raise ValueError(
                    f"layer {i}: offset {off} + {self.num_blocks} blocks x {self.block_stride} B reaches "
                    f"past the {self.dev_bytes} B KV allocation"
                )

    @property
    def num_layers(self) -> int:
        return len(self.layer_offsets)

    @property
    def slot_bytes(self) -> int:
        return self.num_layers * self.page_bytes


class Driver(Protocol):
    """What a CUDA job needs from the driver; :class:`HostDriver` implements it with memcpy."""

    name: str

    def bind(self) -> None:
        """Make the device current in the calling thread (every thread that calls the driver)."""

    def new_stream(self) -> int: ...
    def execute(self, dst: Any, src: Any, size: Any, k: int, direction: int, stream: int) -> None:
        """Issue descriptors ``[0, k)`` of the arrays on ``stream`` (asynchronously for CUDA)."""

    def new_event(self) -> int: ...
    def record(self, event: int, stream: int) -> None: ...
    def wait_event(self, stream: int, event: int) -> None:
        """Later work on ``stream`` starts after ``event`` completed."""

    def query(self, event: int) -> bool:
        """True once the event completed; CudaError if the device reports an error."""

    def sync(self, stream: int) -> None: ...


class CudaDriver:
    """The real driver (libcuda via native/cuda_copy.c), bound to the device with ``uuid``."""

    name = "cuda"

    def __init__(self, uuid: bytes):
        why = cuda_unavailable_reason()
        if why:
            raise CudaUnavailable(why)
        ordinal = ffi.new("int *")
        _check(lib.hpkv_cuda_device_by_uuid(uuid, ordinal), f"finding the GPU with UUID {uuid.hex()}")
        self.ordinal = int(ordinal[0])
        self.bind()

    def bind(self) -> None:
        _check(lib.hpkv_cuda_ctx_bind(self.ordinal), f"binding GPU {self.ordinal}")

    def new_stream(self) -> int:
        out = ffi.new("uint64_t *")
        _check(lib.hpkv_cuda_stream_create(1, out), "creating a low-priority copy stream")
        return int(out[0])

    def execute(self, dst: Any, src: Any, size: Any, k: int, direction: int, stream: int) -> None:
        raise NotImplementedError(
            "CudaCopier calls hpkv_cuda_copy_blocks directly (plan and issue in one call)"
        )

    def new_event(self) -> int:
        out = ffi.new("uint64_t *")
        _check(lib.hpkv_cuda_event_create(1, out), "creating an interprocess event")
        return int(out[0])

    def record(self, event: int, stream: int) -> None:
        _check(lib.hpkv_cuda_event_record(event, stream), "recording an event")

    def wait_event(self, stream: int, event: int) -> None:
        _check(lib.hpkv_cuda_stream_wait_event(stream, event), "making the copy stream wait on an event")

    def query(self, event: int) -> bool:
        rc = lib.hpkv_cuda_event_query(event)
        if rc == lib.HPKV_CU_NOT_READY:
            return False
        _check(rc, "querying an event")
        return True

    def sync(self, stream: int) -> None:
        _check(lib.hpkv_cuda_stream_sync(stream), "synchronising the copy stream")

    def register_host(self, address: int, nbytes: int, chunk: int = HOST_REGISTER_CHUNK) -> int:
        """Page-lock ``[address, address + nbytes)`` in chunks; returns the bytes registered.
        Each return code is checked, so no sticky error is left for a later call to trip on."""
        done = 0
        while done < nbytes:
            n = min(chunk, nbytes - done)
            _check(
                lib.hpkv_cuda_host_register(address + done, n), f"registering {n} B of the pool at +{done}"
            )
            done += n
        return done


class HostDriver:
    """The driver with its device replaced by host memory: descriptors run with memcpy when
    issued. Imported (engine) events are the cells of a shared int64 array, 0 = complete, so
    another process can hold one pending, as a GPU stream does until its forward finished;
    the worker's own events (ids from :meth:`new_event`) complete when recorded, since host
    work is synchronous."""

    name = "host"
    _OWN = 1 << 32  # own event ids start here; lower ids index the shared array

    def __init__(self, events: np.ndarray | None = None, wait_timeout: float = 10.0):
        self.events = events if events is not None else np.zeros(64, np.int64)
        self.wait_timeout = wait_timeout
        self._own: dict[int, bool] = {}

    def bind(self) -> None:
        return

    def new_stream(self) -> int:
        return 1

    def execute(self, dst: Any, src: Any, size: Any, k: int, direction: int, stream: int) -> None:
        lib.hpkv_desc_memcpy(dst, src, size, k)

    def new_event(self) -> int:
        ev = self._OWN + len(self._own)
        self._own[ev] = True
        return ev

    def record(self, event: int, stream: int) -> None:
        if event >= self._OWN:
            self._own[event] = True
        else:
            self.events[event] = 0

    def wait_event(self, stream: int, event: int) -> None:
        deadline = time.monotonic() + self.wait_timeout
        while not self.query(event):
            if time.monotonic() > deadline:
                raise CudaError(
                    f"waiting {self.wait_timeout:g}s for event {event}", 702
                )  # CUDA_ERROR_LAUNCH_TIMEOUT
            time.sleep(0.0005)

    def query(self, event: int) -> bool:
        return self._own[event] if event >= self._OWN else bool(self.events[event] == 0)

    def sync(self, stream: int) -> None:
        return


class CudaCopier:
    """Copies batches of KV blocks between a device allocation and pool slots through ``driver``.

    Not thread-safe (it reuses its descriptor arrays); one per copy thread."""

    def __init__(
        self,
        layout: DeviceLayout,
        pool_address: int,
        slot_stride: int,
        num_slots: int,
        driver: Driver,
        max_pairs: int = 8192,
    ):
        if slot_stride < layout.slot_bytes:
            raise ValueError(
                f"slot_stride {slot_stride} < {layout.num_layers} layers x {layout.page_bytes} B"
            )
        self.layout = layout
        self.driver = driver
        self.pool_address = int(pool_address)
        self.slot_stride = int(slot_stride)
        self.num_slots = int(num_slots)
        self.cap = max_pairs * layout.num_layers
        self._bases = ffi.new("uint64_t[]", [layout.dev_base + o for o in layout.layer_offsets])
        self._c_layout = ffi.new(
            "hpkv_layout *",
            {
                "layer_base": self._bases,
                "num_layers": layout.num_layers,
                "num_blocks": layout.num_blocks,
                "block_stride": layout.block_stride,
                "page_bytes": layout.page_bytes,
            },
        )
        # Reused descriptor arrays (the driver reads them during the call only).
        self.dst = np.zeros(self.cap, np.uint64)
        self.src = np.zeros(self.cap, np.uint64)
        self.size = np.zeros(self.cap, np.uint64)
        self._cdst = ffi.from_buffer("uint64_t[]", self.dst)
        self._csrc = ffi.from_buffer("uint64_t[]", self.src)
        self._csize = ffi.from_buffer("uint64_t[]", self.size)
        self._cu_err = ffi.new("int *")

    def _ids(self, dev_blocks: Any, slots: Any) -> tuple[np.ndarray, np.ndarray, Any, Any]:
        b = np.ascontiguousarray(dev_blocks, np.int64)
        s = np.ascontiguousarray(slots, np.int64)
        if b.ndim != 1 or b.shape != s.shape:
            raise ValueError(f"dev_blocks {b.shape} and slots {s.shape} must be 1-D of one length")
        if len(b) * self.layout.num_layers > self.cap:
            raise ValueError(f"batch of {len(b)} blocks exceeds {self.cap // self.layout.num_layers}")
        return b, s, ffi.from_buffer("int64_t[]", b), ffi.from_buffer("int64_t[]", s)

    def plan(self, dev_blocks: Any, slots: Any, direction: int) -> int:
        """Fill ``dst/src/size[:k]`` with the batch's descriptors; returns k (nothing is copied)."""
        b, s, cb, cs = self._ids(dev_blocks, slots)
        lo = self.layout.dev_base
        rc = lib.hpkv_cuda_plan(
            self._c_layout, lo, lo + self.layout.dev_bytes, self.pool_address, self.slot_stride,
            self.num_slots, cb, cs, len(b), direction, self._cdst, self._csrc, self._csize, self.cap,
        )  # fmt: skip
        if rc < 0:
            self._raise(int(rc), b, s)
        return int(rc)

    def copy(self, dev_blocks: Any, slots: Any, direction: int, stream: int) -> int:
        """Issue the batch on ``stream`` (asynchronous on CUDA); returns the descriptor count."""
        if isinstance(self.driver, CudaDriver):
            b, s, cb, cs = self._ids(dev_blocks, slots)
            lo = self.layout.dev_base
            rc = lib.hpkv_cuda_copy_blocks(
                self._c_layout, lo, lo + self.layout.dev_bytes, self.pool_address, self.slot_stride,
                self.num_slots, cb, cs, len(b), direction, stream, self._cdst, self._csrc, self._csize,
                self.cap, self._cu_err,
            )  # fmt: skip
            if self._cu_err[0]:
                raise CudaError(f"issuing {len(b)} block copies", int(self._cu_err[0]))
            if rc < 0:
                self._raise(int(rc), b, s)
            return int(rc)
        k = self.plan(dev_blocks, slots, direction)
        self.driver.execute(self._cdst, self._csrc, self._csize, k, direction, stream)
        return k

    def _raise(self, rc: int, b: np.ndarray, s: np.ndarray) -> None:
        if rc == lib.HPKV_COPY_EARG:
            raise ValueError("hpkv_cuda_plan rejected its arguments (layout outside the allocation?)")
        pos, kind = (-rc) // lib.HPKV_COPY_ERR_STRIDE, -((-rc) % lib.HPKV_COPY_ERR_STRIDE)
        if kind == lib.HPKV_COPY_EBLOCK:
            which, value, limit = "dev_blocks", int(b[pos]), self.layout.num_blocks
        else:
            which, value, limit = "slots", int(s[pos]), self.num_slots
        raise CopyIndexError(
            f"{which}[{pos}] = {value} is out of range 0..{limit - 1}; nothing of this batch was copied",
            which=which,
            position=pos,
            value=value,
            limit=limit,
        )

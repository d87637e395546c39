"""The CUDA job path of a transfer worker: one engine's KV cache imported once, copies ordered
after the engine's events, one batched DMA call per job.

Registration (``register_device`` with a ``cuda`` object, checked by the server:
:func:`hpkv.engine.devices.validate_cuda`):

* ``driver: "cuda"``: ``uuid`` (32 hex digits, the GPU; ordinals differ between processes),
  ``mem_handle`` (128 hex digits, the CUDA IPC handle of the *allocation base*),
  ``alloc_offset`` / ``alloc_bytes`` (vLLM's buffer inside that allocation), ``events`` (hex
  IPC handles of the engine's interprocess events). ``layer_bases`` are ``[0, offset]`` pairs
  relative to the buffer.
* ``driver: "host"``: the same protocol with the driver replaced by host memory (tests, the
  bench's host mode): the buffer is ``regions[0]`` (a shared-memory file, validated as on the
  CPU path) and the events are the int64 cells of the file ``events`` (0 = complete).

A job (COPY_SAVE / COPY_LOAD) carries ``a1 = event index + 1`` (0: no event): the copy stream
waits for that event (the engine recorded it on its compute stream when it queued the forward),
then the batch is issued, then the worker records its own event and polls it for at most
``cuda.job_timeout_s`` seconds (default ``hpkv.engine.devices.JOB_TIMEOUT_S``). The completion
therefore means the bytes are in place. The engine's KV mapping is closed when the worker stops
(its engine died or shut down), so a dead engine's GPU memory is released.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from hpkv.common.cuda_copy import CudaCopier, CudaDriver, CudaError, DeviceLayout, Driver, HostDriver
from hpkv.common.native import ffi, lib
from hpkv.common.pool import PoolFile
from hpkv.common.ratelimit import RateLimitedLog
from hpkv.common.shm import map_file
from hpkv.protocol import wire as P
from hpkv.protocol.errors import Status
from hpkv.protocol.stats import W
from hpkv.runtime.fence import SlotFence, decode_slots
from hpkv.runtime.worker import WorkerRuntime

log = logging.getLogger("hpkv.transfer")


class _Opened:
    """The driver and the engine's memory and events as this worker sees them."""

    def __init__(self, spec: dict[str, Any]):
        c = spec["cuda"]
        self.imported = 0
        self.keep: list[Any] = []
        if c["driver"] == "host":
            region = map_file(spec["regions"][0]["path"])
            events = np.frombuffer(map_file(c["events"]), np.int64)
            self.keep += [region, events]
            self.driver: Driver = HostDriver(events, wait_timeout=c["job_timeout_s"])
            self.dev_base = int(np.frombuffer(region, np.uint8).ctypes.data)
            self.dev_bytes = spec["regions"][0]["size"]
            self.events = list(range(c["num_events"]))
            return
        drv = CudaDriver(bytes.fromhex(c["uuid"]))
        self.driver = drv
        ptr = ffi.new("uint64_t *")
        rc = lib.hpkv_cuda_mem_import(bytes.fromhex(c["mem_handle"]), ptr)
        if rc:
            raise CudaError("opening the engine's KV cache (cuIpcOpenMemHandle)", rc)
        self.imported = int(ptr[0])
        self.dev_base = self.imported + c["alloc_offset"]
        self.dev_bytes = c["alloc_bytes"]
        self.events = []
        for i, h in enumerate(c["events"]):
            ev = ffi.new("uint64_t *")
            rc = lib.hpkv_cuda_event_import(bytes.fromhex(h), ev)
            if rc:
                raise CudaError(f"opening the engine's event {i} (cuIpcOpenEventHandle)", rc)
            self.events.append(int(ev[0]))

    def close(self) -> None:
        if self.imported:
            rc = lib.hpkv_cuda_mem_close(self.imported)  # releases the dead or departed engine's memory
            log.info("closed the engine's KV cache mapping (%s)", "ok" if rc == 0 else f"CUresult {rc}")
            self.imported = 0


def _register_pool(driver: CudaDriver, pool: PoolFile, row: Any) -> None:
    """Page-lock the pool in the background, chunk by chunk (never on the engine's start-up path).
    Copies before it finishes are correct, only slower (pageable memory)."""
    try:
        driver.bind()
        t0 = time.monotonic()
        done = driver.register_host(pool.address, pool.size)
        log.info("pool pinned for DMA: %d bytes in %.1fs", done, time.monotonic() - t0)
    except CudaError as exc:
        log.warning("cannot pin the pool for DMA (%s): copies use pageable memory, slower", exc)


def _give_up(rt: WorkerRuntime, d: Any, why: str) -> None:
    """A copy that may still be running on the GPU: its slots stay held in the fence and this
    worker ends after answering; the server drops the holds only once this process (and so
    its CUDA context, which stops the DMA) is gone, then starts a new worker."""
    log.error("CUDA job seq %d %s: restarting this worker (its slots stay fenced until then)", d.seq, why)
    rt.stopping = True


def _enter_fence(
    fence: SlotFence,
    holder: int,
    row: Any,
    errors: RateLimitedLog,
    d: Any,
    offsets: np.ndarray,
    gens: np.ndarray,
) -> bool:
    """Hold a save's slots in the fence (False, counted and logged: a late save, refused)."""
    refused = fence.enter(offsets, gens, holder)
    if refused < 0:
        return True
    row[W.STALE_SAVES] += 1
    errors.log(
        logging.WARNING,
        "stale",
        "save seq %d refused, nothing written: the reservation of pool offset %d was released "
        "before the copy",
        d.seq,
        int(offsets[refused]),
    )
    return False


def _well_formed(kind: int, n: int, event: int, num_events: int) -> bool:
    return kind in (P.COPY_SAVE, P.COPY_LOAD) and 0 < n <= P.MAX_PAIRS_PER_JOB and event < num_events


def _wait_done(driver: Any, done: Any, timeout: float, row: Any) -> bool:
    """Poll the job's completion event; False when ``timeout`` seconds passed first."""
    deadline = time.monotonic() + timeout
    while not driver.query(done):
        if time.monotonic() > deadline:
            return False
        row[W.HEARTBEAT_NS] = time.time_ns()  # waiting on the engine (bounded above), not hung
        time.sleep(0.0001)
    return True


def serve_cuda(rt: WorkerRuntime, pool: PoolFile, fence: SlotFence) -> int:
    spec, row = rt.spec, rt.row
    opened = _Opened(spec)
    driver = opened.driver
    layout = DeviceLayout(
        opened.dev_base,
        opened.dev_bytes,
        tuple(int(off) for _, off in spec["layer_bases"]),
        int(spec["block_stride"]),
        int(spec["page_bytes"]),
        int(spec["num_blocks"]),
    )
    slot_bytes = int(spec["slot_bytes"])
    copier = CudaCopier(
        layout, pool.address, slot_bytes, pool.size // slot_bytes, driver, P.MAX_PAIRS_PER_JOB
    )
    stream = driver.new_stream()
    done = driver.new_event()
    timeout = float(spec["cuda"]["job_timeout_s"])
    if isinstance(driver, CudaDriver):
        threading.Thread(target=_register_pool, args=(driver, pool, row), daemon=True, name="pin").start()
    jobs = np.frombuffer(map_file(spec["jobs"]), dtype=np.int64).reshape(P.JOB_SLOTS, P.JOB_SLOT_BYTES // 8)
    log.info(
        "CUDA transfer worker ready (%s driver%s): %d layers x %d B pages, %d blocks, %d events",
        driver.name,
        ", batched copies" if isinstance(driver, CudaDriver) and lib.hpkv_cuda_has_batch() else "",
        layout.num_layers,
        layout.page_bytes,
        layout.num_blocks,
        len(opened.events),
    )

    holder = int(spec["slot"]) + 1
    errors = RateLimitedLog(log)

    def copy(d: Any) -> tuple[int, int, int]:
        n, ev = int(d.a0), int(d.a1) - 1
        if not _well_formed(d.kind, n, ev, len(opened.events)):
            log.error("CUDA job seq %d rejected: kind %d, %d pairs, event %d", d.seq, d.kind, n, ev)
            return Status.BAD_REQUEST, 0, 0
        job = jobs[d.seq % P.JOB_SLOTS]
        direction = lib.HPKV_SAVE if d.kind == P.COPY_SAVE else lib.HPKV_LOAD
        held = queued = False
        try:
            offsets, gens = decode_slots(job[n : 2 * n].copy(), slot_bytes, pool.size)
            if direction == lib.HPKV_SAVE:  # the slot fence, as in the CPU transfer worker
                if not _enter_fence(fence, holder, row, errors, d, offsets, gens):
                    return Status.STALE_SLOT, 0, 0
                held = True
            if ev >= 0:
                driver.wait_event(stream, opened.events[ev])
            queued = True  # from here on the DMA may be running, even if a call below fails
            copier.copy(job[:n].copy(), offsets // slot_bytes, direction, stream)
            driver.record(done, stream)
            if not _wait_done(driver, done, timeout, row):
                held = False  # see _give_up
                _give_up(rt, d, f"not complete after {timeout:.1f}s")
                return -110, 0, 0  # -ETIMEDOUT
        except (ValueError, IndexError) as exc:
            row[W.BAD_JOBS] += 1
            errors.log(logging.ERROR, "bad", "CUDA job seq %d rejected: %s", d.seq, exc)
            return Status.BAD_REQUEST, 0, 0
        except CudaError as exc:
            if not queued:  # the engine's event never came: nothing was copied, go on serving
                log.error("CUDA job seq %d failed: %s", d.seq, exc)
                return Status.INTERNAL, 0, 0
            held = False  # part of the batch may be queued: see _give_up
            _give_up(rt, d, f"failed: {exc}")
            return Status.INTERNAL, 0, 0
        finally:
            if held:
                fence.leave(offsets, gens, holder)
        row[W.BYTES_SAVED if d.kind == P.COPY_SAVE else W.BYTES_LOADED] += n * layout.slot_bytes
        return 0, n * layout.slot_bytes, 0

    try:
        return rt.serve(copy, exit_when_producer_gone=False)
    finally:
        opened.close()

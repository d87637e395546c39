"""The CUDA job path of a transfer worker: one engine's KV cache imported once, copies ordered
after the engine's events, one batched DMA call per job.

Registration (``register_device`` with a ``cuda`` object, checked by :func:`validate_cuda`):

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
``JOB_TIMEOUT_S``. The completion therefore means the bytes are in place. The engine's KV
mapping is closed when the worker stops (its engine died or shut down), so a dead engine's GPU
memory is released.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
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

JOB_TIMEOUT_S = 30.0  # a job whose event or copy has not completed by then fails (the engine recomputes)
MAX_EVENTS = 1024
MAX_LAYERS = 4096
_HEX = set("0123456789abcdef")


def _hex(v: Any, nbytes: int, what: str) -> str:
    if not isinstance(v, str) or len(v) != 2 * nbytes or not set(v) <= _HEX:
        raise ValueError(f"cuda.{what} must be {2 * nbytes} lowercase hex digits, got {str(v)[:40]!r}")
    return v


def _nonneg(c: dict[str, Any], key: str, hi: int) -> int:
    v = c.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= hi:
        raise ValueError(f"{key}={str(v)[:40]!r} must be an integer in 0..{hi}")
    return v


def validate_cuda(
    msg: dict[str, Any],
    slot_bytes: int,
    allowed_uids: set[int],
    validate_device: Callable[[dict[str, Any], int, set[int]], dict[str, Any]],
) -> dict[str, Any]:
    """The spec of a CUDA ``register_device`` call; ValueError names the bad value."""
    c = msg.get("cuda")
    if not isinstance(c, dict) or c.get("driver") not in ("cuda", "host"):
        raise ValueError("cuda must be an object with driver 'cuda' or 'host'")
    if c["driver"] == "host":
        spec = validate_device(msg, slot_bytes, allowed_uids)
        if len(spec["regions"]) != 1:
            raise ValueError("a host-driver CUDA device has one region (its whole KV allocation)")
        n = _nonneg(c, "num_events", MAX_EVENTS)
        ev = validate_device(
            {"regions": [{"path": c.get("events"), "size": max(8 * n, 8)}], "layer_bases": [[0, 0]],
             "block_stride": 8, "page_bytes": 8, "num_blocks": 1},
            1 << 40, allowed_uids,
        )  # fmt: skip
        spec["cuda"] = {"driver": "host", "events": ev["regions"][0]["path"], "num_events": n}
        spec["cuda"]["job_timeout_s"] = _timeout(c)
        return spec
    alloc_bytes = _nonneg(c, "alloc_bytes", 1 << 50)
    events = c.get("events")
    if not isinstance(events, list) or len(events) > MAX_EVENTS:
        raise ValueError(f"cuda.events must be a list of at most {MAX_EVENTS} event handles")
    spec = _check_spans(msg, slot_bytes, alloc_bytes)
    spec["cuda"] = {
        "driver": "cuda",
        "uuid": _hex(c.get("uuid"), 16, "uuid"),
        "mem_handle": _hex(c.get("mem_handle"), 64, "mem_handle"),
        "alloc_offset": _nonneg(c, "alloc_offset", 1 << 50),
        "alloc_bytes": alloc_bytes,
        "events": [_hex(e, 64, f"events[{i}]") for i, e in enumerate(events)],
        "job_timeout_s": _timeout(c),
    }
    return spec


def _timeout(c: dict[str, Any]) -> float:
    v = c.get("job_timeout_s", JOB_TIMEOUT_S)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.1 <= v <= 600:
        raise ValueError(f"cuda.job_timeout_s={str(v)[:40]!r} must be 0.1..600 seconds")
    return float(v)


def _check_spans(msg: dict[str, Any], slot_bytes: int, alloc_bytes: int) -> dict[str, Any]:
    """Every layer's pages lie inside the engine's buffer and one block fits a pool slot."""
    stride = _nonneg(msg, "block_stride", 1 << 40)
    page = _nonneg(msg, "page_bytes", stride)
    num_blocks = _nonneg(msg, "num_blocks", 1 << 31)
    bases = msg.get("layer_bases")
    if not page or not num_blocks or not isinstance(bases, list) or not 1 <= len(bases) <= MAX_LAYERS:
        raise ValueError(f"page_bytes, num_blocks and 1..{MAX_LAYERS} layer_bases [0, offset] are required")
    if len(bases) * page > slot_bytes:
        raise ValueError(
            f"{len(bases)} layers x {page} B pages do not fit the namespace's {slot_bytes} B slot"
        )
    span = (num_blocks - 1) * stride + page
    out = []
    for j, lb in enumerate(bases):
        ok = isinstance(lb, (list, tuple)) and len(lb) == 2 and lb[0] == 0
        off = lb[1] if ok else None
        if not isinstance(off, int) or isinstance(off, bool) or not 0 <= off <= alloc_bytes - span:
            raise ValueError(
                f"layer_bases[{j}] = {str(lb)[:40]}: {num_blocks} blocks x {stride} B from there do not "
                f"fit the {alloc_bytes} B KV buffer"
            )
        out.append([0, off])
    return {
        "regions": [],
        "layer_bases": out,
        "block_stride": stride,
        "page_bytes": page,
        "num_blocks": num_blocks,
    }


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

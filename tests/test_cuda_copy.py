"""The CUDA copy module without a GPU: it builds and imports, says plainly that there is no
driver, and the descriptor list a CUDA job would issue, run by the host executor, moves exactly
the bytes the CPU path (hpkv_copy_blocks) moves."""

from __future__ import annotations

import numpy as np
import pytest

from hpkv.common.cuda_copy import (
    LOAD,
    SAVE,
    CopyIndexError,
    CudaCopier,
    CudaDriver,
    CudaUnavailable,
    DeviceLayout,
    HostDriver,
    cuda_unavailable_reason,
)
from hpkv.common.native import ffi, lib
from hpkv.transfer_workers.copy import BlockCopier, BlockLayout

NO_DRIVER = cuda_unavailable_reason() != ""


@pytest.mark.skipif(not NO_DRIVER, reason="this machine has a CUDA driver")
def test_without_libcuda_every_entry_point_says_so() -> None:
    assert cuda_unavailable_reason().startswith("no libcuda")
    with pytest.raises(CudaUnavailable, match="no libcuda"):
        CudaDriver(b"\0" * 16)
    out = ffi.new("uint64_t *")
    assert lib.hpkv_cuda_stream_create(1, out) == lib.HPKV_CU_NOT_LOADED
    assert lib.hpkv_cuda_event_query(0) == lib.HPKV_CU_NOT_LOADED
    assert lib.hpkv_cuda_host_register(4096, 4096) == lib.HPKV_CU_NOT_LOADED
    assert lib.hpkv_cuda_has_batch() == 0


def _layouts(kind: str, layers: int, blocks: int, page: int) -> tuple[np.ndarray, list[int], int]:
    """(device buffer, layer offsets, block stride) in vLLM's LB (layer-outermost, with a padded
    stride) or BL (block-outermost) nesting."""
    if kind == "LB":
        stride = page + 64  # padded pages: the padding is never copied
        offsets = [ly * blocks * stride for ly in range(layers)]
        nbytes = layers * blocks * stride
    else:
        stride = layers * page
        offsets = [ly * page for ly in range(layers)]
        nbytes = blocks * stride
    return np.zeros(nbytes + 128, np.uint8), offsets, stride


@pytest.mark.parametrize("kind", ["LB", "BL"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_host_executed_descriptors_equal_the_cpu_copy(kind: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    layers, blocks, page, slots_n = 5, 40, 256, 48
    dev, offsets, stride = _layouts(kind, layers, blocks, page)
    dev[:] = rng.integers(0, 256, dev.size, dtype=np.uint8)
    dev_addr = dev.ctypes.data
    slot_stride = layers * page + 512
    pools = [np.zeros(slots_n * slot_stride, np.uint8) for _ in range(2)]
    cpu = BlockCopier(
        BlockLayout(tuple(dev_addr + o for o in offsets), stride, page, blocks, owners=(dev,)),
        pools[0],
        slot_stride,
        slots_n,
    )
    cuda = CudaCopier(
        DeviceLayout(dev_addr, dev.size, tuple(offsets), stride, page, blocks),
        pools[1].ctypes.data,
        slot_stride,
        slots_n,
        HostDriver(),
    )
    n = 30
    b = rng.choice(blocks, n, replace=False).astype(np.int64)
    s = rng.choice(slots_n, n, replace=False).astype(np.int64)
    b[:8], s[:8] = np.arange(3, 11), np.arange(20, 28)  # a run of consecutive blocks and slots
    cpu.save(b, s)
    cuda.copy(b, s, SAVE, stream=1)
    assert np.array_equal(pools[0], pools[1])
    # and back: load into a zeroed device buffer with a different map
    b2 = rng.permutation(b)
    before = dev.copy()
    dev[:] = 0
    cpu.load(b2, s)
    via_cpu = dev.copy()
    dev[:] = 0
    cuda.copy(b2, s, LOAD, stream=1)
    assert np.array_equal(dev, via_cpu)
    assert not np.array_equal(dev, before)  # the test moved something


def test_block_outermost_blocks_into_consecutive_slots_are_one_descriptor() -> None:
    layers, blocks, page = 4, 16, 1024
    dev, offsets, stride = _layouts("BL", layers, blocks, page)
    pool = np.zeros(32 * layers * page, np.uint8)
    c = CudaCopier(
        DeviceLayout(dev.ctypes.data, dev.size, tuple(offsets), stride, page, blocks),
        pool.ctypes.data,
        layers * page,
        32,
        HostDriver(),
    )
    k = c.plan(np.arange(4, 12), np.arange(10, 18), SAVE)
    assert k == 1 and c.size[0] == 8 * layers * page
    k = c.plan([1, 5, 6], [0, 1, 9], LOAD)  # blocks 5, 6 are consecutive but slots 1, 9 are not
    assert k == 3 and list(c.size[:3]) == [layers * page] * 3
    lb_dev, lb_offsets, lb_stride = _layouts("LB", layers, blocks, page)
    lb = CudaCopier(
        DeviceLayout(lb_dev.ctypes.data, lb_dev.size, tuple(lb_offsets), lb_stride, page, blocks),
        pool.ctypes.data,
        layers * page,
        32,
        HostDriver(),
    )
    assert lb.plan(np.arange(4, 12), np.arange(10, 18), SAVE) == 8 * layers  # one per (block, layer)


def test_a_bad_id_is_named_and_nothing_is_planned() -> None:
    dev, offsets, stride = _layouts("BL", 2, 8, 512)
    pool = np.zeros(4 * 1024, np.uint8)
    c = CudaCopier(
        DeviceLayout(dev.ctypes.data, dev.size, tuple(offsets), stride, 512, 8),
        pool.ctypes.data,
        1024,
        4,
        HostDriver(),
    )
    with pytest.raises(CopyIndexError, match=r"dev_blocks\[1\] = 8 is out of range 0..7"):
        c.copy([0, 8], [0, 1], SAVE, 1)
    with pytest.raises(CopyIndexError, match=r"slots\[0\] = -1"):
        c.copy([0, 1], [-1, 1], SAVE, 1)
    assert not pool.any()


def test_a_layout_outside_its_allocation_is_refused() -> None:
    with pytest.raises(ValueError, match="layer 1: offset 4096 .* past the 8192 B KV allocation"):
        DeviceLayout(1 << 20, 8192, (0, 4096), 1024, 1024, 5)

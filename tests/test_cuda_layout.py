"""hpkv's description of a CUDA KV cache, checked against vLLM 0.32's own allocation code.

The views are built by vLLM itself (``get_kv_cache_config_from_groups`` + ``allocate_kv_cache``,
the functions the GPU worker runs) on a CPU buffer: layout code only computes strides, so what
runs here is byte for byte what a GPU worker gets. A byte-ownership map says which (block,
layer) every byte of the allocation belongs to; hpkv's pages must cover exactly each block's
bytes and nothing of any other block or layer.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from hpkv.connectors.vllm.cuda_layout import (  # noqa: E402
    BLOCK_COMPACT,
    CudaKvLayout,
    UnsupportedKvLayout,
    describe_cuda_kv,
    page_order_of,
)

LAYERS = 3
BLOCKS = 6


def _vllm_kv(spec, layout: KVCacheLayout, kernel_block_size: int | None = None):
    """(kv_caches, kv_cache_config) exactly as vLLM's GPU worker builds them, on the CPU."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    cfg = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            num_gpu_blocks_override=BLOCKS,
            prefix_cache_retention_interval=None,
        ),
    )
    kvc = get_kv_cache_config_from_groups(cfg, [KVCacheGroupSpec(names, spec)], available_memory=1 << 30)
    kvc.kv_cache_layout = layout.name
    kernel = None if kernel_block_size is None else [kernel_block_size]
    kv = allocate_kv_cache(kvc, torch.device("cpu"), layout, kernel_block_sizes=kernel)
    return kv, kvc, names


def _ownership(kv: dict[str, torch.Tensor], names: list[str], ratio: int) -> torch.Tensor:
    """owner[byte] = 1 + b * LAYERS + l for the bytes of block b in layer l's view; 0 for none."""
    storage = kv[names[0]].untyped_storage()
    base, nbytes = storage.data_ptr(), storage.nbytes()
    owner = torch.zeros(nbytes, dtype=torch.int64)
    addr = torch.arange(nbytes, dtype=torch.int64)
    for ly, name in enumerate(names):
        t = kv[name]
        es = t.element_size()
        shape = (*t.shape[:-1], t.shape[-1] * es)
        strides = (*(s * es for s in t.stride()[:-1]), 1)
        assert t.stride(-1) == 1
        byte_view = addr.as_strided(shape, strides, t.data_ptr() - base)
        for b in range(BLOCKS):
            cells = byte_view[b * ratio : (b + 1) * ratio].reshape(-1)
            assert (owner[cells] == 0).all(), "vLLM's views overlap: the test set-up is wrong"
            owner[cells] = 1 + b * LAYERS + ly
    return owner


def _assert_covers_exactly(desc: CudaKvLayout, owner: torch.Tensor) -> None:
    counts = torch.bincount(owner, minlength=1 + BLOCKS * LAYERS)
    for b in range(BLOCKS):
        for ly, (off, length) in enumerate(desc.runs(b)):
            run = owner[off : off + length]
            me = 1 + b * LAYERS + ly
            strangers = run[(run != 0) & (run != me)]
            assert strangers.numel() == 0, (
                f"block {b} layer {ly}: page holds bytes of (block, layer) ids {strangers.unique()}"
            )
            assert int((run == me).sum()) == int(counts[me]), (
                f"block {b} layer {ly}: page misses some of its bytes"
            )


SPECS = {
    "bf16": lambda: FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=16, dtype=torch.bfloat16),
    "fp8": lambda: FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.uint8),
    "head_size_v": lambda: FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=24, head_size_v=16, dtype=torch.bfloat16
    ),
    "padded": lambda: FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, page_size_padded=2 * 16 * 64 + 640
    ),
    "mla": lambda: MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=72, dtype=torch.bfloat16),
    "mla_aligned": lambda: MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=70, dtype=torch.bfloat16, alignment=1024
    ),
}


@pytest.mark.parametrize("layout_name", BLOCK_COMPACT)
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_description_covers_exactly_each_blocks_bytes(layout_name: str, kind: str) -> None:
    spec = SPECS[kind]()
    layout = KVCacheLayout[layout_name]
    kv, kvc, names = _vllm_kv(spec, layout)
    desc = describe_cuda_kv(kv, kvc, spec.page_size_bytes, LAYERS)
    assert desc.name == layout_name
    assert desc.num_blocks == BLOCKS and desc.kernel_ratio == 1
    assert desc.dtype == str(spec.dtype)
    assert desc.alloc_base == kv[names[0]].untyped_storage().data_ptr()
    _assert_covers_exactly(desc, _ownership(kv, names, 1))
    # block-outermost without padding between blocks: one run per block, as in a pool slot
    assert desc.block_is_one_run == (layout_name in ("BLNHC", "BLHNC"))


@pytest.mark.parametrize("layout_name", ["LBNHC", "LBHNC"])
def test_kernel_split_blocks_are_regrouped(layout_name: str) -> None:
    spec = SPECS["bf16"]()
    kv, kvc, names = _vllm_kv(spec, KVCacheLayout[layout_name], kernel_block_size=8)
    assert kv[names[0]].shape[0] == 2 * BLOCKS  # vLLM split each block into 2 kernel blocks
    desc = describe_cuda_kv(kv, kvc, spec.page_size_bytes, LAYERS)
    assert desc.kernel_ratio == 2 and desc.num_blocks == BLOCKS
    _assert_covers_exactly(desc, _ownership(kv, names, 2))


@pytest.mark.parametrize("layout_name", ["LHBNC", "BHLNC"])
def test_layouts_with_heads_outside_the_block_are_refused(layout_name: str) -> None:
    spec = SPECS["bf16"]()
    kv, kvc, _ = _vllm_kv(spec, KVCacheLayout[layout_name])
    with pytest.raises(UnsupportedKvLayout, match=f"not one contiguous run.*layout {layout_name}.*LBNHC"):
        describe_cuda_kv(kv, kvc, spec.page_size_bytes, LAYERS)


def test_without_kv_cache_config_the_views_alone_suffice() -> None:
    spec = SPECS["bf16"]()
    kv, kvc, names = _vllm_kv(spec, KVCacheLayout.BLNHC)
    desc = describe_cuda_kv(kv, None, spec.page_size_bytes, LAYERS)
    assert desc.name == "BLNHC" and desc.block_is_one_run
    _assert_covers_exactly(desc, _ownership(kv, names, 1))


def test_kv_sharing_layers_alias_their_target() -> None:
    spec = SPECS["bf16"]()
    kv, _, names = _vllm_kv(spec, KVCacheLayout.LBNHC)
    kv = dict(kv, **{"model.layers.9.self_attn.attn": kv[names[1]]})  # a layer sharing layer 1's cache
    desc = describe_cuda_kv(kv, None, spec.page_size_bytes, LAYERS)
    assert desc.num_layers == LAYERS


def test_a_declared_layout_that_the_strides_contradict_is_refused() -> None:
    spec = SPECS["bf16"]()
    kv, kvc, _ = _vllm_kv(spec, KVCacheLayout.LBNHC)
    kvc.kv_cache_layout = "LBHNC"
    with pytest.raises(UnsupportedKvLayout, match="says layout LBHNC but .* look like LBNHC"):
        describe_cuda_kv(kv, kvc, spec.page_size_bytes, LAYERS)


def test_a_namespace_page_that_does_not_fit_is_refused() -> None:
    spec = SPECS["bf16"]()
    kv, kvc, _ = _vllm_kv(spec, KVCacheLayout.LBNHC)
    with pytest.raises(UnsupportedKvLayout, match="4096 B in the views, 8192 B in the namespace"):
        describe_cuda_kv(kv, kvc, spec.page_size_bytes * 2, LAYERS)
    kv, kvc, _ = _vllm_kv(spec, KVCacheLayout.BLNHC)
    with pytest.raises(
        UnsupportedKvLayout, match="reaches past|overlap"
    ):  # pages would run into other layers
        describe_cuda_kv(kv, kvc, spec.page_size_bytes * 2, LAYERS)
    with pytest.raises(UnsupportedKvLayout, match="namespace expects 4"):
        describe_cuda_kv(kv, kvc, spec.page_size_bytes, LAYERS + 1)


def _pool_image(kv: dict[str, torch.Tensor], names: list[str], desc: CudaKvLayout) -> bytes:
    """Logical values written through vLLM's views, then gathered page by page as hpkv does."""
    for ly, name in enumerate(names):
        t = kv[name]
        g = torch.Generator().manual_seed(ly)
        vals = torch.randint(0, 120, t.shape, generator=g, dtype=torch.int16)
        t.copy_(vals.to(t.dtype))
    raw = torch.empty(0, dtype=torch.uint8).set_(kv[names[0]].untyped_storage())
    out = bytearray()
    for b in range(BLOCKS):
        for off, length in desc.runs(b):
            out += raw[off : off + length].numpy().tobytes()
    return bytes(out)


@pytest.mark.parametrize("order", ["NHC", "HNC"])
def test_layer_and_block_outermost_pages_are_the_same_bytes(order: str) -> None:
    """Why the namespace records the in-page order and not the nesting: LB and BL pool images agree."""
    spec = SPECS["bf16"]()
    images = []
    for outer in ("LB", "BL"):
        kv, kvc, names = _vllm_kv(spec, KVCacheLayout[outer + order])
        desc = describe_cuda_kv(kv, kvc, spec.page_size_bytes, LAYERS)
        images.append(_pool_image(kv, names, desc))
    assert images[0] == images[1]
    kv, kvc, names = _vllm_kv(spec, KVCacheLayout["LB" + ("HNC" if order == "NHC" else "NHC")])
    other = _pool_image(kv, names, describe_cuda_kv(kv, kvc, spec.page_size_bytes, LAYERS))
    assert other != images[0]


def test_page_order_names() -> None:
    assert [page_order_of(n) for n in ("LBNHC", "BLNHC", "LBHNC", "BLHNC", "NHD", "HND", None)] == [
        "NHC",
        "NHC",
        "HNC",
        "HNC",
        "NHC",
        "HNC",
        "NHC",
    ]


@pytest.mark.parametrize("layout_name", [lay.name for lay in KVCacheLayout])
def test_the_device_checks_view_builder_matches_vllm(layout_name: str) -> None:
    """The device check (no vLLM there) builds the KV cache with vllm_views: same views as vLLM's."""
    from hpkv.connectors.vllm.cuda_layout import vllm_views

    spec = SPECS["bf16"]()
    kv, _, names = _vllm_kv(spec, KVCacheLayout[layout_name])
    raw = torch.empty(0, dtype=torch.int8).set_(kv[names[0]].untyped_storage())
    mine = vllm_views(raw, layout_name, LAYERS, BLOCKS, 4, 16, 2 * 16 * 2, torch.bfloat16)
    base = raw.data_ptr()
    for ours, theirs in zip(mine, (kv[n] for n in names), strict=True):
        assert (ours.shape, ours.stride(), ours.dtype) == (theirs.shape, theirs.stride(), theirs.dtype)
        assert ours.data_ptr() - base == theirs.data_ptr() - base

"""Describe (never assume) a CUDA KV cache from the per-layer views vLLM 0.32 hands
``register_kv_caches``.

vLLM allocates the whole KV cache as one ``torch.zeros(int8)`` buffer and gives each layer a
4-D view ``[B, H, N, C]`` whose strides follow one of six ``KVCacheLayout`` permutations of
``[L, B, H, N, C]`` (``vllm/v1/kv_cache_layout.py``). hpkv copies whole pages, so it serves
every *block-compact* layout, where one (block, layer) page is one contiguous run of bytes:

* ``LBNHC`` (vLLM's default on Hopper) and ``LBHNC``: layer-outermost, one run per (block, layer);
* ``BLNHC`` and ``BLHNC``: block-outermost, the L pages of one block are one run, byte-identical
  to hpkv's pool slot (layer ``l`` at ``l * page``), so a block is one copy descriptor.

``LHBNC`` and ``BHLNC`` put the head outside the block (a page is H runs) and are refused.
What is checked here comes from the views' own addresses and strides, cross-checked against
``kv_cache_config.kv_cache_tensors`` and ``kv_cache_config.kv_cache_layout`` when present.
Kernel-block splitting (views with ``num_blocks * ratio`` rows, ``group_kernel_blocks``) and
padded pages (``page_size_padded``) are described too. This module reads only addresses and
strides, never the memory, so it runs on CPU tensors in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: Layouts whose pages are one run each; the block-outermost ones make a block one run.
BLOCK_COMPACT = ("LBNHC", "LBHNC", "BLNHC", "BLHNC")
BLOCK_OUTERMOST = ("BLNHC", "BLHNC")
#: What hpkv asks vLLM for on CUDA (``HPKV_CUDA_BLOCK_OUTERMOST``): a block is one DMA run.
REQUESTED_LAYOUT = "BLNHC"


class UnsupportedKvLayout(ValueError):
    """The KV cache is not laid out so that hpkv can copy whole pages; the message says why."""


@dataclass(frozen=True)
class CudaKvLayout:
    """Where every (block, layer) page of one rank's KV cache lies in its allocation.

    Page of block ``b`` in layer ``l``: ``alloc_base + layer_offsets[l] + b * block_stride``,
    ``page_bytes`` long (a padded page includes its padding, which no view addresses).
    """

    name: str  # the vLLM KVCacheLayout, e.g. "BLNHC"
    page_order: str  # "NHC" or "HNC": the order of the bytes inside one page
    dtype: str
    alloc_base: int  # address of the whole allocation (what a CUDA IPC handle names)
    alloc_bytes: int
    layer_offsets: tuple[int, ...]  # bytes from alloc_base to block 0 of each layer, in L order
    block_stride: int
    page_bytes: int
    num_blocks: int
    kernel_ratio: int  # kernel blocks per vLLM block (rows of a view per block)
    device_index: int = -1

    @property
    def num_layers(self) -> int:
        return len(self.layer_offsets)

    @property
    def slot_bytes(self) -> int:
        return self.num_layers * self.page_bytes

    @property
    def block_is_one_run(self) -> bool:
        """Layers of a block lie back to back, in slot order: one copy per block."""
        o = self.layer_offsets
        return all(o[i] == o[0] + i * self.page_bytes for i in range(len(o)))

    def runs(self, block: int) -> list[tuple[int, int]]:
        """(offset from alloc_base, length) of each page of ``block``, layer by layer."""
        return [(o + block * self.block_stride, self.page_bytes) for o in self.layer_offsets]

    def device_spec(self) -> dict[str, Any]:
        """The layout fields of a CUDA ``register_device`` call (offsets relative to the allocation)."""
        return dict(
            layout_name=self.name,
            alloc_bytes=self.alloc_bytes,
            layer_offsets=list(self.layer_offsets),
            block_stride=self.block_stride,
            page_bytes=self.page_bytes,
            num_blocks=self.num_blocks,
        )


def _byte_strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(s * t.element_size() for s in t.stride())


def _dense_row_bytes(t: torch.Tensor, what: str, layout_hint: str) -> int:
    """Bytes of one view row ``[H, N, C]`` when it is one dense run; UnsupportedKvLayout otherwise."""
    shape, strides = tuple(t.shape), _byte_strides(t)
    run = t.element_size()
    for size, stride in sorted(
        ((s, st) for s, st in zip(shape[1:], strides[1:], strict=True) if s != 1), key=lambda p: p[1]
    ):
        if stride != run:
            raise UnsupportedKvLayout(
                f"{what}: a KV cache page is not one contiguous run (shape {shape}, byte strides "
                f"{strides}{layout_hint}); hpkv copies block-compact layouts only "
                f"({', '.join(BLOCK_COMPACT)}). Unset VLLM_KV_CACHE_LAYOUT or set it to one of these"
            )
        run *= size
    return run


def _page_order(t: torch.Tensor) -> str:
    """'HNC' when heads are outside tokens inside a page, else 'NHC'."""
    return "HNC" if t.shape[1] > 1 and t.shape[2] > 1 and t.stride(1) > t.stride(2) else "NHC"


def page_order_of(layout_name: str | None) -> str:
    """The in-page byte order a resolved vLLM layout name implies (what the namespace records)."""
    return "HNC" if layout_name in ("LBHNC", "BLHNC", "HND") else "NHC"


def _distinct_layers(kv_caches: dict[str, torch.Tensor], kvc: KVCacheConfig | None) -> list[torch.Tensor]:
    """One view per distinct layer, in L order. KV-sharing layers alias their target's view."""
    if kvc is not None and len(kvc.kv_cache_tensors) == 1:
        names = [n for n in kvc.kv_cache_tensors[0].layers if n in kv_caches]
        if len(names) == len(kvc.kv_cache_tensors[0].layers):
            return [kv_caches[n] for n in names]
    seen: dict[int, torch.Tensor] = {}
    for t in kv_caches.values():
        seen.setdefault(t.data_ptr(), t)
    return sorted(seen.values(), key=lambda t: t.data_ptr())


def _infer_name(order: str, offsets: list[int], block_stride: int) -> str:
    """LB when each layer's blocks form its own region, BL when a block holds every layer."""
    outer = "BL" if len(offsets) > 1 and offsets[-1] - offsets[0] < block_stride else "LB"
    return outer + order


def describe_cuda_kv(
    kv_caches: dict[str, torch.Tensor],
    kv_cache_config: KVCacheConfig | None,
    page_bytes: int,
    num_layers: int,
) -> CudaKvLayout:
    """The :class:`CudaKvLayout` of the views vLLM passed to ``register_kv_caches``.

    ``page_bytes`` and ``num_layers`` come from the namespace (:class:`~.layout.Layout`).
    Raises UnsupportedKvLayout naming the value that does not fit."""
    layers = _distinct_layers(kv_caches, kv_cache_config)
    if len(layers) != num_layers:
        raise UnsupportedKvLayout(
            f"{len(layers)} distinct KV cache views, the namespace expects {num_layers}"
        )
    declared = getattr(kv_cache_config, "kv_cache_layout", None) if kv_cache_config is not None else None
    hint = f", layout {declared}" if declared else ""
    t0 = layers[0]
    storage = t0.untyped_storage()
    alloc_base, alloc_bytes = storage.data_ptr(), storage.nbytes()
    rows = t0.shape[0]
    num_blocks = int(kv_cache_config.num_blocks) if kv_cache_config is not None else 0
    if num_blocks <= 0:
        num_blocks = rows
    if rows % num_blocks:
        raise UnsupportedKvLayout(f"views have {rows} rows, not a multiple of {num_blocks} blocks")
    ratio = rows // num_blocks
    offsets: list[int] = []
    geometry: set[tuple[Any, ...]] = set()
    for i, t in enumerate(layers):
        what = f"KV cache view {i}"
        if t.dim() != 4:
            raise UnsupportedKvLayout(f"{what}: expected a 4-D [B, H, N, C] view, got shape {tuple(t.shape)}")
        if t.untyped_storage().data_ptr() != alloc_base:
            raise UnsupportedKvLayout(f"{what} lies in another allocation than view 0; hpkv needs one")
        row = _dense_row_bytes(t, what, hint)
        row_stride = _byte_strides(t)[0] if t.shape[0] > 1 else row
        if ratio > 1 and row_stride != row:
            raise UnsupportedKvLayout(
                f"{what}: {ratio} kernel blocks per block but rows are {row_stride} B apart, not "
                f"the {row} B of a row: a split block must be one dense page"
            )
        geometry.add((tuple(t.shape), _byte_strides(t), str(t.dtype), _page_order(t)))
        offsets.append(t.data_ptr() - alloc_base)
    if len(geometry) != 1:
        raise UnsupportedKvLayout(f"KV cache views differ in shape, strides or dtype: {sorted(geometry)}")
    shape, strides, dtype, order = geometry.pop()
    if declared and (shape[1] == 1 or shape[2] == 1):
        order = page_order_of(declared)  # one head (MLA) or one token: NHC and HNC are the same bytes
    row = _dense_row_bytes(t0, "KV cache view 0", hint)
    block_stride = (strides[0] if rows > 1 else row) * ratio
    view_page = row * ratio
    if not view_page <= page_bytes <= block_stride:
        raise UnsupportedKvLayout(
            f"a block's page is {view_page} B in the views, {page_bytes} B in the namespace, and "
            f"blocks are {block_stride} B apart: the namespace page must lie between the two"
        )
    name = _infer_name(order, offsets, block_stride)
    if declared and declared != name:
        raise UnsupportedKvLayout(
            f"kv_cache_config says layout {declared} but the views' strides {strides} and layer "
            f"offsets {offsets[:3]}... look like {name}"
        )
    desc = CudaKvLayout(
        name=name,
        page_order=order,
        dtype=dtype,
        alloc_base=alloc_base,
        alloc_bytes=alloc_bytes,
        layer_offsets=tuple(offsets),
        block_stride=block_stride,
        page_bytes=page_bytes,
        num_blocks=num_blocks,
        kernel_ratio=ratio,
        device_index=t0.device.index if t0.device.index is not None else -1,
    )
    _check_against_config(desc, kv_cache_config)
    _check_disjoint(desc)
    return desc


def _check_against_config(desc: CudaKvLayout, kvc: KVCacheConfig | None) -> None:
    """The engine core's own placement (``KVCacheTensor``) must agree with what the views say."""
    if kvc is None or len(kvc.kv_cache_tensors) != 1:
        return
    kvt = kvc.kv_cache_tensors[0]
    o = desc.layer_offsets
    layer_stride = o[1] - o[0] if len(o) > 1 else kvt.layer_stride
    want = (kvt.offset, kvt.layer_stride, kvt.block_stride)
    got = (o[0], layer_stride, desc.block_stride)
    if want != got or any(o[i] != o[0] + i * layer_stride for i in range(len(o))):
        raise UnsupportedKvLayout(
            f"KV cache views (offset, layer stride, block stride) = {got} disagree with vLLM's "
            f"KVCacheTensor {want}"
        )
    if kvt.size > desc.alloc_bytes:
        raise UnsupportedKvLayout(
            f"KVCacheTensor size {kvt.size} exceeds the {desc.alloc_bytes} B allocation"
        )


def _check_disjoint(desc: CudaKvLayout) -> None:
    """Every page lies in the allocation and no two pages (of any block and layer) overlap."""
    nb, s, p = desc.num_blocks, desc.block_stride, desc.page_bytes
    last = (nb - 1) * s + p
    for i, o in enumerate(desc.layer_offsets):
        if o < 0 or o + last > desc.alloc_bytes:
            raise UnsupportedKvLayout(
                f"layer {i}: offset {o} + {nb} blocks x {s} B reaches past the {desc.alloc_bytes} B allocation"
            )
    # Pages (i, b1) and (j, b2) overlap iff |d + k*s| < p for d = o_i - o_j, k = b1 - b2 in
    # (-nb, nb); only the two k nearest -d/s can qualify.
    offs = desc.layer_offsets
    for i in range(len(offs)):
        for j in range(i + 1, len(offs)):
            d = offs[i] - offs[j]
            for k in (-d // s, -d // s + 1):
                if -nb < k < nb and abs(d + k * s) < p:
                    raise UnsupportedKvLayout(
                        f"pages of layers {i} and {j} overlap (offsets {offs[i]}, {offs[j]}, block stride {s}, "
                        f"page {p} B)"
                    )


_PERMUTATION = {  # vLLM's KVCacheLayout values: physical order of the logical [L, B, H, N, C] axes
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def vllm_views(
    buf: torch.Tensor, layout_name: str, num_layers: int, num_blocks: int, heads: int, block_size: int,
    head_bytes: int, dtype: torch.dtype,
) -> list[torch.Tensor]:  # fmt: skip
    """The per-layer ``[B, H, N, C]`` views vLLM 0.32 makes over its int8 buffer (unpadded pages,
    no kernel split), for machines without vLLM (the device check). ``head_bytes`` is the K+V
    bytes of one (head, token) cell. tests/test_cuda_layout.py checks it against vLLM's code."""
    shape = (num_layers, num_blocks, heads, block_size, head_bytes)
    strides = [0] * 5
    step = 1
    for dim in reversed(_PERMUTATION[layout_name]):
        strides[dim] = step
        step *= shape[dim]
    if buf.numel() < step:
        raise ValueError(f"buffer of {buf.numel()} B, the layout needs {step} B")
    view = torch.as_strided(buf, shape, strides, buf.storage_offset())
    return [view[ly].view(dtype) for ly in range(num_layers)]

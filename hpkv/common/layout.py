"""Where a KV-cache layer's pages lie, written once for every layout that checks it (the
server's device-spec validation, the host and CUDA copy layouts, the SGLang host pool): page
``b`` of a layer at ``base + b * block_stride``, ``page_bytes`` long, ``num_blocks`` pages."""

from __future__ import annotations


def pages_span(num_blocks: int, block_stride: int, page_bytes: int) -> int:
    """Bytes from a layer's base to the end of its last page."""
    return (num_blocks - 1) * block_stride + page_bytes


def pages_fit(offset: int, size: int, num_blocks: int, block_stride: int, page_bytes: int) -> bool:
    """A layer whose pages start at ``offset`` lies inside ``size`` bytes."""
    return offset >= 0 and offset + pages_span(num_blocks, block_stride, page_bytes) <= size

"""A fake device for tests and benchmarks: KV memory in shared-memory files, laid out like an engine's cache."""

from __future__ import annotations

import mmap
import os

import numpy as np


class Device:
    """A fake device's KV memory in shared-memory files, laid out like an engine's cache."""

    def __init__(self, directory, layers, blocks, page, layout, pad=0):
        self.layers, self.blocks, self.page = layers, blocks, page
        stride = page + pad
        self.maps, regions, bases = [], [], []
        if layout == "block_outermost":
            stride = layers * page
            regions.append(self._region(directory, "dev-all", blocks * stride))
            bases = [(0, ly * page) for ly in range(layers)]
        else:
            for ly in range(layers):
                regions.append(self._region(directory, f"dev-l{ly}", blocks * stride))
                bases.append((ly, 0))
        self.stride = stride
        self.layout = layout
        self.spec = dict(
            regions=regions, layer_bases=bases, block_stride=stride, page_bytes=page, num_blocks=blocks
        )

    def _region(self, directory, name, size):
        path = os.path.join(directory, name)
        with open(path, "wb") as f:
            f.truncate(size)
        fd = os.open(path, os.O_RDWR)
        self.maps.append(np.frombuffer(mmap.mmap(fd, size), np.uint8))
        os.close(fd)
        return {"path": path, "size": size}

    def page_view(self, block: int, layer: int) -> np.ndarray:
        if self.layout == "block_outermost":
            off = block * self.stride + layer * self.page
            return self.maps[0][off : off + self.page]
        off = block * self.stride
        return self.maps[layer][off : off + self.page]

    def block_bytes(self, block: int) -> bytes:
        return b"".join(self.page_view(block, ly).tobytes() for ly in range(self.layers))

    def fill_random(self, rng):
        for m in self.maps:
            m[:] = rng.integers(0, 256, m.size, dtype=np.uint8)


def make_device(
    tmp_path, layers: int = 4, blocks: int = 16, page: int = 4096, layout: str = "per_layer", pad: int = 0
) -> Device:
    """A device under ``tmp_path``: ``per_layer`` regions (optionally padded pages) or ``block_outermost``."""
    d = tmp_path / f"dev-{layout}-{pad}"
    d.mkdir(exist_ok=True)
    return Device(str(d), layers, blocks, page, layout, pad)

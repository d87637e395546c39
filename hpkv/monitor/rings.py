"""Fill level of ring files, read without claiming an end (native/ringpeek.c)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import NamedTuple

from hpkv.common.native import ffi, lib

RING_SUFFIX = ".ring"


class RingLevel(NamedTuple):
    depth: int
    capacity: int


def peek(directory: str, name: str) -> RingLevel | None:
    """Depth and capacity of ring ``name`` in ``directory``; None if it is gone or unreadable."""

    fn = getattr(lib, "hpkv_ring_peek", None)
    if fn is None:  # a core built before ringpeek.c: depths unknown until it is rebuilt
        return None
    depth = ffi.new("uint64_t *")
    cap = ffi.new("uint32_t *")
    path = os.path.join(directory, name + RING_SUFFIX).encode()
    if fn(path, depth, cap) != 0:
        return None
    return RingLevel(int(depth[0]), int(cap[0]))


def peek_all(directory: str, names: Iterable[str]) -> dict[str, RingLevel | None]:
    return {name: peek(directory, name) for name in names}
